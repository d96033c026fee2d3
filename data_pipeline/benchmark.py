"""Preprocessing throughput against the tokenizer's own speed, and peak memory vs input size.

    python -m data_pipeline.benchmark \\
        --tokenizer tiktoken:.venv/lib/python3.11/site-packages/llama_models/llama3/tokenizer.model \\
        --repeats 3 --rss-scale 10 --json /tmp/dp-bench/llama3.json
    # the same comparison on 571 MB (the corpus 10 times), where start-up weighs less:
    python -m data_pipeline.benchmark -t tiktoken:... --repeats 3 --rss-scale 1 --text-scale 10

On >= 50 MB of real English text from Debian packages (see debian_text), one run measures:
  (a)  the tokenizer alone: load it, then encode every document (already in memory) in
       one process; the load (~0.2 s for Llama-3's 128k ranks) is timed because
       preprocess loads the tokenizer once too, and also reported apart;
  (a2) two such processes at once (aggregate throughput);
  (b)  `python -m data_pipeline.preprocess --workers 1` on the same documents (jsonl);
  (c)  the same with --workers 2;
and reports MB/s (10^6 bytes of UTF-8 text) and tokens/s, medians over --repeats runs
interleaved a, a2, b, c. (b) and (c) are timed inside preprocess (from argument checks to
the committed output, worker start-up included; not the CLI's Megatron-Core import, which
is reported apart). Also MB of text per CPU-second over all processes of a run, which
other jobs on the machine do not skew. Peak memory is that of the whole preprocess
process tree (PSS summed, sampled every 0.2 s) in two extra runs with 2 workers: on the
corpus and on the corpus repeated --rss-scale times.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPORA = ["kjv", "jargon", "python-doc", "perl-doc", "linux-doc"]


def _encode_worker(spec: str, corpus: str, barrier, results) -> None:
    """(a)/(a2): read the documents into memory (untimed), then load the tokenizer and
    encode them all (timed, the load apart too: preprocess also loads it once)."""
    from data_pipeline.tokenizers import load_tokenizer

    with open(corpus, "rb") as f:
        texts = [json.loads(line)["text"] for line in f]
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    barrier.wait()
    start, cpu = time.perf_counter(), time.process_time()
    tokenizer = load_tokenizer(spec)
    loaded = time.perf_counter()
    tokens = sum(len(tokenizer.encode_array(text)) for text in texts)
    results.put((start, time.perf_counter(), text_bytes, tokens, time.process_time() - cpu,
                 loaded - start))


def tokenizer_alone(spec: str, corpus: str, processes: int) -> dict:
    """Aggregate encode throughput of `processes` simultaneous processes."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_encode_worker, args=(spec, corpus, barrier, results))
             for _ in range(processes)]
    for proc in procs:
        proc.start()
    runs = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    seconds = max(r[1] for r in runs) - min(r[0] for r in runs)
    return {"seconds": seconds, "text_bytes": sum(r[2] for r in runs),
            "tokens": sum(r[3] for r in runs), "cpu_seconds": sum(r[4] for r in runs),
            "load_seconds": max(r[5] for r in runs)}


class TreeMemorySampler:
    """Peak memory of a process and all its descendants, summed. Forked workers share
    the parent's pages, so each process counts its proportional share (PSS) of every
    page where Linux reports it, else its RSS."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        import psutil

        self._root = psutil.Process(pid)
        self._interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self._root] + self._root.children(recursive=True)
                total = 0
                for proc in procs:
                    try:
                        info = proc.memory_full_info()
                        total += getattr(info, "pss", info.rss)
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
            except psutil.Error:
                return
            self._stop.wait(self._interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_preprocess(spec: str, corpus: str, workers: int, work_dir: str,
                   sample_memory: bool = False) -> dict:
    """One CLI run; timing from its --summary-json, optionally the peak memory of its
    process tree (sampling reads /proc smaps, so timed runs go without it)."""
    prefix = os.path.join(work_dir, f"out-w{workers}")
    for ext in (".bin", ".idx", ".meta.json"):
        if os.path.exists(prefix + ext):
            os.unlink(prefix + ext)
    summary_path = prefix + ".summary.json"
    command = [sys.executable, "-m", "data_pipeline.preprocess", "-i", corpus, "-o", prefix,
               "-t", spec, "--append-eod", "-j", str(workers), "--no-progress",
               "--summary-json", summary_path]
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = TreeMemorySampler(proc.pid) if sample_memory else None
    err = proc.stderr.read()
    # wait4, not wait: the kernel's own peak RSS of the CLI and its workers comes with it.
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stderr.close()
    wall = time.perf_counter() - started
    peak = sampler.stop() if sampler else None
    if proc.returncode != 0:
        raise RuntimeError(f"preprocess failed:\n{err.decode()}")
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    return {"seconds": summary["seconds"], "text_bytes": summary["text_bytes"],
            "tokens": summary["tokens"], "cli_wall_seconds": wall, "peak_rss": peak,
            # Largest single process of the tree, as the kernel counted it (ru_maxrss, KiB).
            "kernel_max_rss": usage.ru_maxrss * 1024,
            "cpu_seconds": summary["main_cpu_seconds"] + summary["worker_cpu_seconds"],
            "worker_cpu_seconds": summary["worker_cpu_seconds"]}


def ensure_corpus(work_dir: str, cache_dir: str | None) -> str:
    from data_pipeline import debian_text

    os.makedirs(work_dir, exist_ok=True)
    corpus = os.path.join(work_dir, "debian.jsonl")
    if not os.path.exists(corpus):
        count, size = debian_text.write_jsonl(CORPORA, corpus, cache_dir or debian_text.DEFAULT_CACHE)
        print(f"corpus: {count:,} documents, {size / 1e6:.1f} MB of text -> {corpus}")
    return corpus


def repeated(corpus: str, scale: int) -> str:
    """The corpus written `scale` times over into one file (made once, atomically)."""
    if scale <= 1:
        return corpus
    path = corpus.replace(".jsonl", f"-x{scale}.jsonl")
    if not os.path.exists(path):
        with open(path + ".partial", "wb") as out:
            for _ in range(scale):
                with open(corpus, "rb") as f:
                    while block := f.read(1 << 24):
                        out.write(block)
        os.replace(path + ".partial", path)
    return path


def _rate(run: dict) -> tuple[float, float]:
    return run["text_bytes"] / run["seconds"] / 1e6, run["tokens"] / run["seconds"]


def benchmark(spec: str, work_dir: str, repeats: int, rss_scale: int,
              cache_dir: str | None = None, text_scale: int = 1) -> dict:
    base = ensure_corpus(work_dir, cache_dir)
    corpus = repeated(base, text_scale)  # what the timed runs read
    big = repeated(base, rss_scale) if rss_scale > 1 else None
    runs: dict[str, list[dict]] = {"a": [], "a2": [], "b": [], "c": []}
    load = []  # 1-minute load average before each repeat: other work skews every number
    for repeat in range(repeats):
        load.append(round(os.getloadavg()[0], 2))
        runs["a"].append(tokenizer_alone(spec, corpus, 1))
        runs["a2"].append(tokenizer_alone(spec, corpus, 2))
        runs["b"].append(run_preprocess(spec, corpus, 1, work_dir))
        runs["c"].append(run_preprocess(spec, corpus, 2, work_dir))
        print(f"repeat {repeat + 1}/{repeats}: " + ", ".join(
            f"{k} {_rate(v[-1])[0]:.2f} MB/s" for k, v in runs.items()), flush=True)
    result = {"tokenizer": spec, "corpus": corpus, "repeats": repeats,
              "text_mb": runs["a"][0]["text_bytes"] / 1e6, "cpus": os.cpu_count(),
              "load_average": load}
    for key, values in runs.items():
        rates = [_rate(v) for v in values]
        result[key] = {"mb_s": statistics.median(r[0] for r in rates),
                       "tok_s": statistics.median(r[1] for r in rates),
                       "all_mb_s": [round(r[0], 3) for r in rates],
                       # MB of text per CPU-second, all processes of the run together
                       "mb_per_cpu_s": statistics.median(
                           v["text_bytes"] / v["cpu_seconds"] / 1e6 for v in values)}
    for key in ("b", "c"):
        result[key]["cli_wall_s"] = statistics.median(v["cli_wall_seconds"] for v in runs[key])
        result[key]["inside_s"] = statistics.median(v["seconds"] for v in runs[key])
    result["a"]["load_s"] = statistics.median(v["load_seconds"] for v in runs["a"])
    result["a"]["encode_only_mb_s"] = statistics.median(
        v["text_bytes"] / (v["seconds"] - v["load_seconds"]) / 1e6 for v in runs["a"])
    result["b_over_a"] = result["b"]["mb_s"] / result["a"]["mb_s"]
    result["c_over_a2"] = result["c"]["mb_s"] / result["a2"]["mb_s"]
    result["a2_over_a"] = result["a2"]["mb_s"] / result["a"]["mb_s"]
    # The pipeline's CPU cost relative to the tokenizer's, immune to other jobs' load.
    result["cpu_efficiency_b"] = result["b"]["mb_per_cpu_s"] / result["a"]["mb_per_cpu_s"]
    result["cpu_efficiency_c"] = result["c"]["mb_per_cpu_s"] / result["a"]["mb_per_cpu_s"]
    if big is not None:
        small = run_preprocess(spec, base, 2, work_dir, sample_memory=True)
        large = run_preprocess(spec, big, 2, work_dir, sample_memory=True)
        result["rss"] = {"small_mb": small["peak_rss"] / 1e6,
                         "small_text_mb": small["text_bytes"] / 1e6,
                         "large_mb": large["peak_rss"] / 1e6,
                         "large_text_mb": large["text_bytes"] / 1e6,
                         "large_mb_s": _rate(large)[0]}
    return result


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result['tokenizer']} on {result['text_mb']:.1f} MB of text, "
                        f"medians of {result['repeats']}")
    for column in ("run", "MB/s", "tokens/s", "runs (MB/s)", "MB/CPU-s"):
        table.add_column(column, justify="left" if column == "run" else "right")
    names = {"a": "(a) tokenizer, 1 process", "a2": "(a2) tokenizer, 2 processes",
             "b": "(b) preprocess, 1 worker", "c": "(c) preprocess, 2 workers"}
    for key, name in names.items():
        row = result[key]
        table.add_row(name, f"{row['mb_s']:.2f}", f"{row['tok_s']:,.0f}",
                      " ".join(f"{x:.2f}" for x in row["all_mb_s"]),
                      f"{row['mb_per_cpu_s']:.2f}")
    console = Console()
    console.print(table)
    verdict = lambda ok: "[green]met[/green]" if ok else "[red]missed[/red]"  # noqa: E731
    console.print(f"(b)/(a) = {result['b_over_a']:.1%} (target >= 85%: "
                  f"{verdict(result['b_over_a'] >= 0.85)}); (c)/(a2) = {result['c_over_a2']:.1%} "
                  f"(target >= 90%: {verdict(result['c_over_a2'] >= 0.90)}); "
                  f"(a2)/(a) = {result['a2_over_a']:.2f}x")
    console.print(f"CPU efficiency vs the tokenizer alone (MB per CPU-second, all processes): "
                  f"(b) {result['cpu_efficiency_b']:.1%}, (c) {result['cpu_efficiency_c']:.1%}")
    console.print(f"(a) without the tokenizer load ({result['a']['load_s']:.2f} s): "
                  f"{result['a']['encode_only_mb_s']:.2f} MB/s")
    console.print(f"1-minute load average before each repeat: {result['load_average']}")
    console.print(f"CLI wall time incl. imports: (b) {result['b']['cli_wall_s']:.1f} s vs "
                  f"{result['b']['inside_s']:.1f} s inside preprocess")
    if "rss" in result:
        rss = result["rss"]
        console.print(f"peak memory (PSS of the process tree), 2 workers: {rss['small_mb']:.0f} MB for {rss['small_text_mb']:.0f}"
                      f" MB of text, {rss['large_mb']:.0f} MB for {rss['large_text_mb']:.0f} MB "
                      f"({rss['large_mb_s']:.2f} MB/s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.benchmark",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", "-t", required=True)
    parser.add_argument("--work-dir", default="/tmp/dp-bench")
    parser.add_argument("--cache-dir", default=None, help="Debian package cache")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rss-scale", type=int, default=10,
                        help="also run on the corpus repeated N times, for peak RSS (1: skip)")
    parser.add_argument("--text-scale", type=int, default=1,
                        help="time (a)-(c) on the corpus repeated N times: start-up costs "
                             "(~0.25 s) weigh less, as on a real multi-GB input")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    for name in ("repeats", "rss_scale", "text_scale"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    result = benchmark(args.tokenizer, args.work_dir, args.repeats, args.rss_scale,
                       args.cache_dir, args.text_scale)
    print_report(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
