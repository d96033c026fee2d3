"""Preprocessing throughput per encoder against the tokenizers alone, and peak memory.

    python -m data_pipeline.benchmark --repeats 3 --rss-scale 1 \
        --tokenizer .venv/lib/python3.11/site-packages/mistral_common/data/tokenizer.model.v1 \
        --json /tmp/dp-bench/mistral.json
    python -m data_pipeline.benchmark --repeats 3 --rss-scale 1 \
        --tokenizer tiktoken:.venv/lib/python3.11/site-packages/llama_models/llama3/tokenizer.model

On real English text from Debian packages (see debian_text; ~108 MB of distinct text, ~75
MB where the mirror lacks linux-doc-6.12: then --text-scale 2 makes the >= 100 MB the issue
asks for; gigatoken caches pieces it has encoded, so a repeated corpus flatters its encode
time, and overheads weigh more), each repeat runs, in this order (interleaved: the machine
is shared, and load drifts over minutes):
  a:reference   the reference tokenizer alone: load it, encode every document (already in
                memory) one by one in one process; the load is timed (preprocess loads it
                too) and also reported apart;
  a:gigatoken   the same with gigatoken (fast_encoders), ~1 MiB of documents per call, as
                preprocess's workers call it, on 1 thread; its load is gigatoken's own
                tokenizer only;
  a2:gigatoken  two such processes at once (aggregate);
  t2:gigatoken  one process encoding each batch on 2 Rust threads (the threads-vs-processes
                question for --workers);
  f:gigatoken   gigatoken reading the .jsonl itself (its encode_files, 1 thread): what its
                own Rust JSON reader costs on top of the encoding, for comparison (without
                the reference's cuts of long documents, so not always the same ids);
  b:ENCODER     `python -m data_pipeline.preprocess --workers 1 --encoder ENCODER` (one
                process: preprocess.IN_PROCESS_WORKERS);
  b1:ENCODER    the same with one worker process beside the main process, as -j1 ran
                before IN_PROCESS_WORKERS (the measurement behind it);
  c:ENCODER     the same with --workers 2.
It reports MB/s (10^6 bytes of UTF-8 text) and tokens/s, medians over --repeats, and MB of
text per CPU-second over all processes of a run, which other jobs on the machine skew
least. Preprocess runs are timed inside preprocess (from argument checks to the committed
output: tokenizer load, encoder probe, worker start-up included; not the CLI's imports,
whose CPU is reported apart with the main and worker CPU of each preprocess run), and the
same rate after start-up: without the CPU spent before the first document (alone: the load;
preprocess: checks, loads, the probe, worker start), the rate a multi-TB input settles at.
The probe's reference ids come from fast_encoders' cache after a tokenizer's first run, as
for users.
Peak memory: the whole preprocess process tree (PSS summed, sampled every 0.05 s) in
--rss-repeats extra runs (median; default 1) per encoder and --rss-workers count (default
-j2) on the corpus repeated --rss-scale times (0: skip); with --rss-baseline CHECKOUT, also
that checkout's preprocess, e.g. the tree the issue called "today's" (the commit before
gigatoken, 9294f05: `git worktree add /tmp/before 9294f05`); with --rss-worker-memory-mb
MB ..., gigatoken at each --worker-memory-mb (peak, MB per CPU-second, workers replaced: the
trade behind its defaults); --rss-unique-words MB runs them all on MB of random distinct
words instead of the corpus; and with --unique-words MB,
on MB of random distinct words, with gigatoken's workers replaced as they grow (the
default --worker-memory-mb) and never replaced.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPORA = ["kjv", "jargon", "python-doc", "perl-doc", "linux-doc", "gcide", "git-doc", "postgresql-doc"]
# linux-doc-6.12 (bookworm-security) was missing from this mirror once: without it the
# corpus is ~75 MB, and --text-scale 2 makes the >= 100 MB the issue asks for.


def _encode_worker(spec: str, corpus: str, barrier, results, encoder: str = "reference",
                   threads: int = 1) -> None:
    """(a)/(a2)/(f): read the documents into memory (untimed), then load the tokenizer and
    encode them all (timed, the load apart too: preprocess also loads it once). The
    reference encodes document by document, as it does in preprocess; gigatoken ~1 MiB of
    documents per call, as preprocess's workers do, on `threads` Rust threads. Gigatoken's
    load is its own tokenizer (from fast_encoders' cached tokenizer.json): the reference,
    whose cutting rules GigatokenEncoder follows, is loaded before the clock starts, since
    gigatoken alone needs none of its encoder. `jsonl`: gigatoken reads the file itself
    (encode_files; its JSON parsing timed, its awkward import not)."""
    if threads > 1:
        os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when gigatoken's pool starts
    from data_pipeline.tokenizers import load_tokenizer

    with open(corpus, "rb") as f:
        texts = [json.loads(line)["text"] for line in f]
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    batches, size = [[]], 0
    for text in texts:
        batches[-1].append(text)
        size += len(text)
        if size >= 1 << 20:
            batches.append([])
            size = 0
    if encoder != "reference":
        from data_pipeline.fast_encoders import GigatokenEncoder

        tokenizer = load_tokenizer(spec)
    if encoder == "jsonl":
        import awkward  # encode_files returns an awkward array; its import is not timed
    barrier.wait()
    start, cpu = time.perf_counter(), time.process_time()
    if encoder == "reference":
        tokenizer = load_tokenizer(spec)
        loaded, loaded_cpu = time.perf_counter(), time.process_time()
        tokens = sum(len(tokenizer.encode_array(text)) for text in texts)
    else:
        fast = GigatokenEncoder(tokenizer)
        loaded, loaded_cpu = time.perf_counter(), time.process_time()
        if encoder == "jsonl":
            import gigatoken

            ids = fast._tok.encode_files(gigatoken.JsonlFileSource([corpus], field="text"), parallel=False)
            tokens = int(awkward.sum(awkward.num(ids, axis=1)))
        elif threads > 1:  # one batch at a time, spread over the pool's threads
            tokens = sum(len(a) for b in batches for a in fast._tok.encode_batch(b, parallel=True))
        else:
            tokens = sum(len(fast.encode_documents(b)[0]) for b in batches)
    results.put((start, time.perf_counter(), text_bytes, tokens, time.process_time() - cpu,
                 loaded - start, loaded_cpu - cpu))


def tokenizer_alone(spec: str, corpus: str, processes: int, encoder: str = "reference",
                    threads: int = 1) -> dict:
    """Aggregate encode throughput of `processes` simultaneous processes."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_encode_worker, args=(spec, corpus, barrier, results, encoder, threads))
             for _ in range(processes)]
    for proc in procs:
        proc.start()
    runs = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    seconds = max(r[1] for r in runs) - min(r[0] for r in runs)
    return {"seconds": seconds, "text_bytes": sum(r[2] for r in runs),
            "tokens": sum(r[3] for r in runs), "cpu_seconds": sum(r[4] for r in runs),
            "load_seconds": max(r[5] for r in runs), "startup_cpu_seconds": sum(r[6] for r in runs)}


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
                   sample_memory: bool = False, encoder: str | None = "auto", extra: tuple[str, ...] = (),
                   checkout: str = REPO, sample_interval: float = 0.2) -> dict:
    """One CLI run; timing from its --summary-json, optionally the peak memory of its
    process tree (sampling reads /proc smaps, so timed runs go without it). `checkout`:
    the tree whose preprocess runs (another commit's, for --rss-baseline); `encoder` None
    passes no --encoder (a tree from before it had none); `sample_interval`: seconds between
    samples (a run on a small corpus is over in ~0.2 s)."""
    from data_pipeline.tokenizers import absolute_spec

    # Absolute paths: the CLI runs in `checkout`, not in this process's directory.
    spec, corpus, prefix = absolute_spec(spec), os.path.abspath(corpus), os.path.abspath(
        os.path.join(work_dir, f"out-w{workers}"))
    cli = ["-m", "data_pipeline.preprocess"]
    if workers == ONE_WORKER_PROCESS:  # -j1 as a worker process, as before IN_PROCESS_WORKERS
        cli = ["-c", "import sys, data_pipeline.preprocess as p; p.IN_PROCESS_WORKERS = 0; "
                     "sys.exit(p.main(sys.argv[1:]))"]
        workers = 1
    for ext in (".bin", ".idx", ".meta.json"):
        if os.path.exists(prefix + ext):
            os.unlink(prefix + ext)
    summary_path = prefix + ".summary.json"
    command = [sys.executable, *cli, "-i", corpus, "-o", prefix,
               "-t", spec, "--append-eod", "-j", str(workers), "--no-progress",
               "--summary-json", summary_path, *(["--encoder", encoder] if encoder else []), *extra]
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=checkout, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = TreeMemorySampler(proc.pid, sample_interval) if sample_memory else None
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
            # Largest single process of the tree, as the kernel counted it (ru_maxrss, KiB; it
            # includes this process's RSS at the fork, before the CLI's exec).
            "kernel_max_rss": usage.ru_maxrss * 1024,
            "cpu_seconds": summary["main_cpu_seconds"] + summary["worker_cpu_seconds"],
            "worker_cpu_seconds": summary["worker_cpu_seconds"],
            "main_cpu_seconds": summary["main_cpu_seconds"],
            # Absent from the summaries of trees before them (--rss-baseline).
            "startup_cpu_seconds": summary.get("startup_cpu_seconds"),
            "replaced_workers": summary.get("replaced_workers"),
            # The whole CLI with its workers, imports included (trees before index_file also
            # imported megatron.core for the output writer: ~3.7-9 CPU-s, either encoder).
            "cli_cpu_seconds": usage.ru_utime + usage.ru_stime}


def corpus_path(work_dir: str) -> str:
    """Where ensure_corpus keeps the corpus: named by its corpora, so a work dir made with
    another list is not read as this one."""
    tag = hashlib.sha256(",".join(CORPORA).encode()).hexdigest()[:8]
    return os.path.join(work_dir, f"debian-{tag}.jsonl")


def ensure_corpus(work_dir: str, cache_dir: str | None) -> str:
    from data_pipeline import debian_text

    os.makedirs(work_dir, exist_ok=True)
    corpus = corpus_path(work_dir)
    if not os.path.exists(corpus):
        cache = cache_dir or debian_text.DEFAULT_CACHE
        available = []
        for name in CORPORA:
            try:
                next(debian_text.documents(name, cache), None)  # fetches it once
                available.append(name)
            except debian_text.DebianTextUnavailable as err:
                print(f"corpus {name} left out: {err}")
        count, size = debian_text.write_jsonl(available, corpus, cache)
        print(f"corpus: {count:,} documents, {size / 1e6:.1f} MB of text -> {corpus}")
    return corpus


def unique_words(work_dir: str, megabytes: int) -> str:
    """A .jsonl of `megabytes` MB of random 8-letter words (seeded: the same file each time),
    ~45 kB documents: nearly every word is new, the worst case for a cache of encoded
    pieces (gigatoken's). Made once, atomically."""
    import random
    import string

    path = os.path.join(work_dir, f"unique-words-{megabytes}mb.jsonl")
    if not os.path.exists(path):
        rng, size = random.Random(0), 0
        with open(path + ".partial", "w", encoding="ascii") as out:
            while size < megabytes * 10**6:
                text = " ".join("".join(rng.choices(string.ascii_lowercase, k=8)) for _ in range(5000))
                out.write(json.dumps({"text": text}) + "\n")
                size += len(text)
        os.replace(path + ".partial", path)
    return path


def unique_words_memory(spec: str, work_dir: str, megabytes: int) -> dict:
    """Peak memory of preprocess -j2 --encoder gigatoken on unique_words(megabytes), with the
    default --worker-memory-mb and with workers never replaced."""
    from data_pipeline.preprocess import DEFAULT_WORKER_MEMORY_MB

    corpus = unique_words(work_dir, megabytes)
    runs = {}
    for label, limit in (("default", DEFAULT_WORKER_MEMORY_MB), ("never replaced", 1 << 30)):
        run = run_preprocess(spec, corpus, 2, work_dir, sample_memory=True, encoder="gigatoken",
                             extra=("--worker-memory-mb", str(limit)))
        runs[label] = {"worker_memory_mb": limit, "peak_mb": run["peak_rss"] / 1e6,
                       "kernel_max_rss_mb": run["kernel_max_rss"] / 1e6,
                       "replaced_workers": run["replaced_workers"], "text_mb": run["text_bytes"] / 1e6}
    return runs


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


# Seconds between samples of the peak-memory runs (not timed, so sampling's CPU is no cost):
# without megatron.core's import a run on 100 MB lasts a few seconds, and a peak lasts as long
# as a chunk's encode; at 0.2 s the samples missed some (Llama-3 -j2 peaks read 605-648 MB at
# 0.2 s against 631-632 at 0.05, docs/benchmarks.md).
RSS_SAMPLE_INTERVAL = 0.05
ONE_WORKER_PROCESS = -1  # RUNS' workers for b1: -j1 with a worker process beside the main one
# key: (what, encoder, processes or workers, threads, description)
RUNS = {
    "a:reference": ("alone", "reference", 1, 1, "reference tokenizer alone, 1 process"),
    "a:gigatoken": ("alone", "gigatoken", 1, 1, "gigatoken alone, 1 process, 1 thread"),
    "a2:gigatoken": ("alone", "gigatoken", 2, 1, "gigatoken alone, 2 processes"),
    "f:gigatoken": ("alone", "jsonl", 1, 1, "gigatoken reading the .jsonl itself, 1 thread"),
    "t2:gigatoken": ("alone", "gigatoken", 1, 2, "gigatoken alone, 1 process, 2 threads"),
    "b:reference": ("preprocess", "reference", 1, 1, "preprocess -j1 --encoder reference"),
    "b:gigatoken": ("preprocess", "gigatoken", 1, 1, "preprocess -j1 --encoder gigatoken"),
    "b1:reference": ("preprocess", "reference", ONE_WORKER_PROCESS, 1, "preprocess -j1 as a worker process, reference"),
    "b1:gigatoken": ("preprocess", "gigatoken", ONE_WORKER_PROCESS, 1, "preprocess -j1 as a worker process, gigatoken"),
    "c:reference": ("preprocess", "reference", 2, 1, "preprocess -j2 --encoder reference"),
    "c:gigatoken": ("preprocess", "gigatoken", 2, 1, "preprocess -j2 --encoder gigatoken"),
}


def _one_run(key: str, spec: str, corpus: str, work_dir: str) -> dict:
    what, encoder, count, threads, _ = RUNS[key]
    if what == "alone":
        return tokenizer_alone(spec, corpus, count, encoder, threads)
    return run_preprocess(spec, corpus, count, work_dir, encoder=encoder)


def _medians(values: list[dict]) -> dict:
    rates = [_rate(v) for v in values]
    return {"mb_s": statistics.median(r[0] for r in rates),
            "tok_s": statistics.median(r[1] for r in rates),
            "all_mb_s": [round(r[0], 3) for r in rates],
            # MB of text per CPU-second, all processes of the run together: what other
            # jobs on a shared machine skew least
            "mb_per_cpu_s": statistics.median(v["text_bytes"] / v["cpu_seconds"] / 1e6 for v in values),
            # the same without the CPU spent before the first document (loads, probes): the
            # rate a run settles at, which is what a multi-TB input sees
            "mb_per_stream_cpu_s": statistics.median(
                v["text_bytes"] / (v["cpu_seconds"] - v["startup_cpu_seconds"]) / 1e6 for v in values),
            "startup_cpu_seconds": statistics.median(v["startup_cpu_seconds"] for v in values),
            "seconds": statistics.median(v["seconds"] for v in values),
            **{key: statistics.median(v[key] for v in values)
               for key in ("main_cpu_seconds", "worker_cpu_seconds", "cli_cpu_seconds") if key in values[0]}}


def benchmark(spec: str, work_dir: str, repeats: int, rss_scale: int, cache_dir: str | None = None,
              text_scale: int = 1, keys: list[str] | None = None, unique_mb: int = 0,
              rss_workers: tuple[int, ...] = (2,), rss_repeats: int = 1,
              rss_baseline: str | None = None, rss_worker_memory: tuple[int, ...] = (),
              rss_unique_mb: int = 0) -> dict:
    """Every run of `keys` (default all of RUNS) `repeats` times, interleaved (a, b, ...,
    a, b, ...): on a shared machine, load drifts over minutes, so no variant gets all
    the quiet (or all the busy) minutes. The peak-memory runs read the corpus repeated
    `rss_scale` times, or `rss_unique_mb` MB of random distinct words if given."""
    keys = keys or list(RUNS)
    base = ensure_corpus(work_dir, cache_dir)
    corpus = repeated(base, text_scale)  # what the timed runs read
    runs: dict[str, list[dict]] = {key: [] for key in keys}
    load = []  # 1-minute load average before each repeat: other work skews every number
    for repeat in range(repeats):
        load.append(round(os.getloadavg()[0], 2))
        for key in keys:
            runs[key].append(_one_run(key, spec, corpus, work_dir))
        print(f"repeat {repeat + 1}/{repeats}: " + ", ".join(
            f"{k} {_rate(v[-1])[0]:.2f} MB/s" for k, v in runs.items()), flush=True)
    what, _, count, _, _ = RUNS[keys[0]]
    processes = count if what == "alone" else 1  # an "alone" run counts each process's text
    result = {"tokenizer": spec, "corpus": corpus, "repeats": repeats, "cpus": os.cpu_count(),
              "text_mb": runs[keys[0]][0]["text_bytes"] / 1e6 / processes,
              "load_average": load, "runs": {key: _medians(values) for key, values in runs.items()}}
    for key in keys:
        if RUNS[key][0] == "alone":
            result["runs"][key]["load_s"] = statistics.median(v["load_seconds"] for v in runs[key])
    result["ratios"] = _ratios(result["runs"])
    if rss_scale >= 1 or rss_unique_mb >= 1:
        rss_corpus = unique_words(work_dir, rss_unique_mb) if rss_unique_mb >= 1 else repeated(base, rss_scale)
        result["rss_corpus"] = rss_corpus
        result["rss"] = peak_memory(spec, rss_corpus, work_dir, rss_workers,
                                    rss_repeats, rss_baseline, worker_memory=rss_worker_memory)
    if unique_mb >= 1:
        result["unique_words"] = unique_words_memory(spec, work_dir, unique_mb)
    return result


def checkout_name(path: str) -> str:
    """`path` and its commit, where git can say."""
    try:
        commit = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return path
    return f"{path} ({commit})"


def peak_memory(spec: str, corpus: str, work_dir: str, workers: tuple[int, ...], repeats: int = 1,
                baseline: str | None = None, sample_interval: float = RSS_SAMPLE_INTERVAL,
                worker_memory: tuple[int, ...] = ()) -> dict:
    """Peak memory (PSS of the process tree) of preprocess at each worker count with each
    encoder, the median of `repeats` runs each, interleaved; with `baseline`, also another
    checkout's preprocess (its default encoder), e.g. the commit before gigatoken: "peak
    memory as today's" in issue 26 is that tree's; with `worker_memory`, also gigatoken at
    each --worker-memory-mb (the trade behind its defaults: peak, MB per CPU-second, workers
    replaced)."""
    variants = [(f"--encoder {encoder}", encoder, REPO, ()) for encoder in ("reference", "gigatoken")]
    variants += [(f"--encoder gigatoken --worker-memory-mb {limit}", "gigatoken", REPO,
                  ("--worker-memory-mb", str(limit))) for limit in worker_memory]
    if baseline:
        variants.append((f"at {checkout_name(baseline)}", None, baseline, ()))
    runs: dict[str, list[dict]] = {}
    for _ in range(repeats):
        for count in workers:
            for label, encoder, checkout, extra in variants:
                runs.setdefault(f"-j{count} {label}", []).append(run_preprocess(
                    spec, corpus, count, work_dir, sample_memory=True, encoder=encoder,
                    checkout=checkout, sample_interval=sample_interval, extra=extra))
    result = {}
    for key, values in runs.items():
        peaks = [v["peak_rss"] / 1e6 for v in values]
        result[key] = {"peak_mb": statistics.median(peaks), "all_peak_mb": [round(p) for p in peaks],
                       "text_mb": values[0]["text_bytes"] / 1e6,
                       "mb_per_cpu_s": statistics.median(v["text_bytes"] / 1e6 / v["cpu_seconds"] for v in values)}
        if values[0]["replaced_workers"] is not None:  # None from trees before it (baseline)
            result[key]["replaced_workers"] = statistics.median(v["replaced_workers"] for v in values)
    return result


def _ratios(runs: dict) -> dict:
    """The issue's targets and the threads-vs-processes comparison, where both runs exist:
    each as MB/s (wall) and as MB per CPU-second (`_cpu`), the per-core measure."""
    wanted = {
        # >= 4x: preprocess per core with gigatoken vs today's (the reference)
        "per_core_speedup": ("b:gigatoken", "b:reference"),
        # >= 85%: preprocess vs gigatoken alone
        "b_over_a_gigatoken": ("b:gigatoken", "a:gigatoken"),
        "b1_over_a_gigatoken": ("b1:gigatoken", "a:gigatoken"),
        # in the main process against one worker process (preprocess.IN_PROCESS_WORKERS)
        "b_over_b1_gigatoken": ("b:gigatoken", "b1:gigatoken"),
        "b_over_a_reference": ("b:reference", "a:reference"),
        "c_over_a2_gigatoken": ("c:gigatoken", "a2:gigatoken"),
        # preprocess against gigatoken's own .jsonl reader, and that reader against its encode
        "b_over_f_gigatoken": ("b:gigatoken", "f:gigatoken"),
        "f_over_a_gigatoken": ("f:gigatoken", "a:gigatoken"),
        "threads_over_processes": ("t2:gigatoken", "a2:gigatoken"),
    }
    ratios = {}
    for name, (top, bottom) in wanted.items():
        if top in runs and bottom in runs:
            ratios[name] = runs[top]["mb_s"] / runs[bottom]["mb_s"]
            ratios[f"{name}_cpu"] = runs[top]["mb_per_cpu_s"] / runs[bottom]["mb_per_cpu_s"]
            ratios[f"{name}_stream_cpu"] = runs[top]["mb_per_stream_cpu_s"] / runs[bottom]["mb_per_stream_cpu_s"]
    return ratios


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result['tokenizer']} on {result['text_mb']:.1f} MB of text, "
                        f"medians of {result['repeats']} interleaved runs")
    for column in ("run", "MB/s", "tokens/s", "runs (MB/s)", "MB/CPU-s", "start-up CPU-s",
                   "MB/CPU-s after"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for key, row in result["runs"].items():
        table.add_row(RUNS[key][4], f"{row['mb_s']:.2f}", f"{row['tok_s']:,.0f}",
                      " ".join(f"{x:.2f}" for x in row["all_mb_s"]), f"{row['mb_per_cpu_s']:.2f}",
                      f"{row['startup_cpu_seconds']:.2f}", f"{row['mb_per_stream_cpu_s']:.2f}")
    console = Console()
    if not console.is_terminal:  # a log file: rows on one line each, not wrapped at 80 columns
        console = Console(width=160)
    console.print(table)
    for name, value in result["ratios"].items():
        console.print(f"{name}: {value:.2f}")
    for key, row in result["runs"].items():
        if "cli_cpu_seconds" in row:
            console.print(f"{key}: CPU-s medians: main {row['main_cpu_seconds']:.2f}, workers "
                          f"{row['worker_cpu_seconds']:.2f}, whole CLI with imports {row['cli_cpu_seconds']:.2f}")
    console.print(f"1-minute load average before each repeat: {result['load_average']}")
    for label, run in result.get("unique_words", {}).items():
        console.print(f"peak memory, preprocess -j2 --encoder gigatoken on {run['text_mb']:.0f} MB of unique words, "
                      f"workers {label} (--worker-memory-mb {run['worker_memory_mb']}): {run['peak_mb']:.0f} MB "
                      f"(largest process {run['kernel_max_rss_mb']:.0f} MB; {run['replaced_workers']} replaced)")
    if "rss_corpus" in result:
        console.print(f"peak-memory runs on {result['rss_corpus']}:")
    for command, rss in result.get("rss", {}).items():
        runs = rss.get("all_peak_mb", [])
        console.print(f"peak memory (PSS of the process tree), preprocess {command}: "
                      f"{rss['peak_mb']:.0f} MB for {rss['text_mb']:.0f} MB of text"
                      + (f" (median of {' '.join(map(str, runs))})" if len(runs) > 1 else "")
                      + (f"; {rss['mb_per_cpu_s']:.2f} MB/CPU-s" if "mb_per_cpu_s" in rss else "")
                      + (f", {rss['replaced_workers']:g} replaced" if "replaced_workers" in rss else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.benchmark",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", "-t", required=True)
    parser.add_argument("--work-dir", default="/tmp/dp-bench")
    parser.add_argument("--cache-dir", default=None, help="Debian package cache")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rss-scale", type=int, default=10,
                        help="peak memory of preprocess (-j of --rss-workers) with each encoder on "
                             "the corpus repeated N times (0: skip)")
    parser.add_argument("--rss-workers", type=int, nargs="+", default=[2], metavar="N",
                        help="--workers of the peak-memory runs (default 2; e.g. 1 2)")
    parser.add_argument("--rss-repeats", type=int, default=1, metavar="N",
                        help="peak-memory runs per variant (the median is reported; default 1)")
    parser.add_argument("--rss-baseline", default=None, metavar="CHECKOUT",
                        help="also the peak memory of the preprocess in this checkout of another "
                             "commit (e.g. a `git worktree` of the one before gigatoken), run from "
                             "it with its default encoder")
    parser.add_argument("--rss-worker-memory-mb", type=int, nargs="+", default=[], metavar="MB",
                        help="also gigatoken's peak-memory runs at each --worker-memory-mb, with MB "
                             "per CPU-second and workers replaced (e.g. 32 64 256)")
    parser.add_argument("--rss-unique-words", type=int, default=0, metavar="MB",
                        help="run the peak-memory runs (--rss-workers, --rss-repeats, "
                             "--rss-worker-memory-mb) on MB of random distinct words instead of "
                             "the corpus: gigatoken's worst case (its cache grows with every word)")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=None,
                        help="which runs (default: all), in this order in every repeat")
    parser.add_argument("--text-scale", type=int, default=1,
                        help="time (a)-(c) on the corpus repeated N times: start-up costs "
                             "(~0.25 s) weigh less, as on a real multi-GB input")
    parser.add_argument("--unique-words", type=int, default=0, metavar="MB",
                        help="also the peak memory of preprocess -j2 with gigatoken on MB of random "
                             "distinct words, with and without replacing grown workers (0: skip)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if min(args.rss_workers) < 0:
        parser.error("--rss-workers must be >= 0")
    if args.rss_worker_memory_mb and min(args.rss_worker_memory_mb) < 1:
        parser.error("--rss-worker-memory-mb must be >= 1 (MiB)")
    if args.rss_baseline and not os.path.isfile(os.path.join(args.rss_baseline, "data_pipeline", "preprocess.py")):
        parser.error(f"--rss-baseline {args.rss_baseline!r} is not a checkout of this repository "
                     "(no data_pipeline/preprocess.py); make one with `git worktree add DIR COMMIT`")
    if args.rss_unique_words < 0:
        parser.error("--rss-unique-words must be >= 0 (MB; 0: the corpus)")
    for name in ("repeats", "text_scale", "rss_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    result = benchmark(args.tokenizer, args.work_dir, args.repeats, args.rss_scale,
                       args.cache_dir, args.text_scale, args.runs, args.unique_words,
                       tuple(args.rss_workers), args.rss_repeats, args.rss_baseline,
                       tuple(args.rss_worker_memory_mb), args.rss_unique_words)
    print_report(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
