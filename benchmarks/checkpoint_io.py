"""Checkpoint I/O benchmark: training stall per checkpoint (sync vs async upload) and the
uploader's throughput against a raw ``pyarrow.fs.copy_files`` of the same files.

Backends: local disk, S3 (a SeaweedFS server started here) and Azure Blob (an Azurite
emulator started here), all on this machine. Checkpoints: 50 MB and 500 MB of random
bytes in 4 files (MB = 10^6 bytes).

No Ray cluster: the worker-side code path is driven in-process, exactly as a worker runs
it. A ``raylastic.session.Session`` (rank 0 of a 1-worker group) with an ``AsyncUploader``
receives ``report(metrics, checkpoint=Checkpoint.from_directory(d))`` and we time that
call on the calling ("training") thread:

- sync stall: ``CheckpointConfig(async_upload=False)``: stage (local copy + CRC32) + upload.
- async stall: ``async_upload=True``: stage only; the upload runs in the background. Between
  checkpoints the benchmark waits for the upload (training longer than an upload, the
  regime async upload is for); back-pressure (``wait_s``) is reported separately.
- uploader throughput: bytes / the background upload time of the staged directory
  (``ReportRecord.upload_s``, from both modes).
- upload_dir direct: ``Storage.upload_dir`` of the (clean, unstaged) source files, to tell
  the storage seam's own speed from the effect of staging (the staged copy was just written,
  and the kernel flushes it to disk while it is being uploaded).
- raw throughput: ``pyarrow.fs.copy_files(src, dst, destination_filesystem=storage.fs,
  use_threads=True)`` of the same 4 files to the same backend (same filesystem object the
  Storage uses).

Targets (issue "Object-storage checkpoints"): async stall <= 5 % of the sync stall;
uploader throughput >= 80 % of the raw copy.

Writes benchmarks/results/checkpoint_io.json. Usage:
    python benchmarks/checkpoint_io.py [--quick] [--sizes 50,500] [--backends local,s3,azure] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NUM_FILES = 4
TARGET_STALL_RATIO = 0.05
TARGET_THROUGHPUT_RATIO = 0.80
MB = 1_000_000


def make_checkpoint(root: str, size_bytes: int) -> str:
    """``size_bytes`` of random bytes in NUM_FILES files (random: no store can compress it)."""
    os.makedirs(root, exist_ok=True)
    per_file = size_bytes // NUM_FILES
    for i in range(NUM_FILES):
        with open(os.path.join(root, f"shard_{i}.bin"), "wb") as fh:
            left = per_file
            while left:
                n = min(left, 16 * MB)
                fh.write(os.urandom(n))
                left -= n
    return root


def _session(storage, run_rel: str, async_upload: bool, staging_root: str):
    from raylastic.checkpoint.uploader import AsyncUploader
    from raylastic.session import GroupSpec, RestoreInfo, Session

    spec = GroupSpec(epoch=1, rank=0, world_size=1, local_rank=0, local_world_size=1,
                     node_rank=0, master_addr="127.0.0.1", master_port=0, backend="gloo")
    uploader = AsyncUploader(storage, staging_root=staging_root)
    return Session(spec=spec, storage=storage, run_rel=run_rel, run_name="bench",
                   restore=RestoreInfo(), uploader=uploader, async_upload=async_upload)


def measure_report(storage, src: str, run_rel: str, async_upload: bool, reps: int,
                   staging_root: str) -> List[Dict[str, float]]:
    """``reps`` checkpoints through ``Session.report``; the stall is timed on this thread."""
    from ray.train import Checkpoint

    sess = _session(storage, run_rel, async_upload, staging_root)
    out = []
    for i in range(reps):
        t0 = time.perf_counter()
        sess.report({"step": i + 1}, checkpoint=Checkpoint.from_directory(src))
        stall = time.perf_counter() - t0
        sess.uploader.wait()  # "training" outlasts the upload (not timed)
        sess.raise_upload_error()
        records = [r for r in sess.drain() if r.checkpoint_rel]
        assert len(records) == 1, records
        rec = records[0]
        out.append({"stall_s": stall, "stage_s": rec.stage_s, "wait_s": rec.wait_s,
                    "upload_s": rec.upload_s})
        storage.delete_dir(rec.checkpoint_rel)
    return out


def measure_raw(storage, src: str, rel: str, reps: int) -> List[float]:
    import pyarrow.fs as pafs

    out = []
    for i in range(reps):
        dst = storage.path(f"{rel}/{i}")
        if storage.is_local:  # copy_files does not create local parent directories
            os.makedirs(dst, exist_ok=True)
        t0 = time.perf_counter()
        pafs.copy_files(src, dst, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=storage.fs, use_threads=True)
        out.append(time.perf_counter() - t0)
        storage.delete_dir(f"{rel}/{i}")
    return out


def measure_upload_dir(storage, src: str, rel: str) -> float:
    """``Storage.upload_dir`` of the clean source files (no staging): the storage seam alone."""
    t0 = time.perf_counter()
    storage.upload_dir(src, rel)
    dt = time.perf_counter() - t0
    storage.delete_dir(rel)
    return dt


def bench_backend(name: str, uri: str, sources: Dict[int, str], reps: Dict[int, int],
                  scratch: str) -> List[Dict[str, Any]]:
    from raylastic.checkpoint.storage import Storage

    storage = Storage(uri, create_container=True)
    storage.write_bytes("bench/warmup", b"x")  # bucket check + connection warm-up
    storage.delete_file("bench/warmup")
    rows = []
    for size_mb, src in sources.items():
        n = reps[size_mb]
        size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
        staging = os.path.join(scratch, f"staging-{name}-{size_mb}")
        t_start = time.perf_counter()
        # Interleave the three measurements and rotate their order every rep, so drift (other
        # jobs on the machine, a server warming up or filling its memory) hits all alike.
        sync, asyn, raw, direct = [], [], [], []
        steps = [
            lambda i: direct.append(measure_upload_dir(storage, src, f"bench/{name}-{size_mb}-direct-{i}")),
            lambda i: sync.extend(measure_report(storage, src, f"bench/{name}-{size_mb}-sync-{i}", False, 1, staging)),
            lambda i: asyn.extend(measure_report(storage, src, f"bench/{name}-{size_mb}-async-{i}", True, 1, staging)),
            lambda i: raw.extend(measure_raw(storage, src, f"bench/{name}-{size_mb}-raw-{i}", 1)),
        ]
        for i in range(n):
            for k in range(len(steps)):
                steps[(i + k) % len(steps)](i)
        med = statistics.median
        sync_stall = med(r["stall_s"] for r in sync)
        async_stall = med(r["stall_s"] for r in asyn)
        upload_s = med(r["upload_s"] for r in sync + asyn)
        raw_s = med(raw)
        row = {
            "backend": name, "size_mb": size_mb, "bytes": size, "files": NUM_FILES, "reps": n,
            "sync_stall_s": round(sync_stall, 4),
            "async_stall_s": round(async_stall, 4),
            "stage_s": round(med(r["stage_s"] for r in sync + asyn), 4),
            "async_wait_s": round(med(r["wait_s"] for r in asyn), 4),
            "uploader_upload_s": round(upload_s, 4),
            "uploader_MBps": round(size / upload_s / MB, 1),
            "uploader_end_to_end_MBps": round(size / sync_stall / MB, 1),
            "upload_dir_direct_MBps": round(size / med(direct) / MB, 1),
            "raw_copy_s": round(raw_s, 4),
            "raw_copy_MBps": round(size / raw_s / MB, 1),
            "stall_ratio": round(async_stall / sync_stall, 4),
            "throughput_ratio": round(raw_s / upload_s, 4),
            "samples": {"sync_stall_s": [round(r["stall_s"], 4) for r in sync],
                        "async_stall_s": [round(r["stall_s"], 4) for r in asyn],
                        "upload_s": [round(r["upload_s"], 4) for r in sync + asyn],
                        "raw_copy_s": [round(x, 4) for x in raw],
                        "upload_dir_direct_s": [round(x, 4) for x in direct]},
            "wall_s": round(time.perf_counter() - t_start, 1),
        }
        row["meets_stall_target"] = row["stall_ratio"] <= TARGET_STALL_RATIO
        row["meets_throughput_target"] = row["throughput_ratio"] >= TARGET_THROUGHPUT_RATIO
        rows.append(row)
        print(f"  {name:5s} {size_mb:4d} MB: stall sync {sync_stall:6.3f} s, async {async_stall:6.3f} s "
              f"(ratio {row['stall_ratio']:.3f}); upload {row['uploader_MBps']:7.1f} MB/s vs raw "
              f"{row['raw_copy_MBps']:7.1f} MB/s (ratio {row['throughput_ratio']:.2f}; upload_dir of the unstaged "
              f"files {row['upload_dir_direct_MBps']:.1f} MB/s) [{row['wall_s']} s]",
              flush=True)
        shutil.rmtree(staging, ignore_errors=True)
    return rows


def markdown(rows: List[Dict[str, Any]]) -> str:
    lines = [
        "| backend | size | sync stall | async stall | async/sync (target <= 0.05) | uploader | raw copy_files | uploader/raw (target >= 0.80) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['size_mb']} MB | {r['sync_stall_s']:.3f} s | {r['async_stall_s']:.3f} s "
            f"| {r['stall_ratio']:.3f} {'ok' if r['meets_stall_target'] else 'MISSED'} "
            f"| {r['uploader_MBps']:.0f} MB/s | {r['raw_copy_MBps']:.0f} MB/s "
            f"| {r['throughput_ratio']:.2f} {'ok' if r['meets_throughput_target'] else 'MISSED'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="50 MB only, 2 reps (a smoke run)")
    ap.add_argument("--sizes", default="50,500", help="checkpoint sizes in MB (default 50,500)")
    ap.add_argument("--backends", default="local,s3,azure")
    ap.add_argument("--reps", type=int, default=3, help="checkpoints per mode and size (default 3)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "checkpoint_io.json"))
    args = ap.parse_args(argv)
    sizes = [50] if args.quick else [int(s) for s in args.sizes.split(",") if s]
    reps = {s: (2 if args.quick else args.reps) for s in sizes}
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]

    import pyarrow

    t_all = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="raylastic-ckptio-")
    servers: List[Any] = []
    rows: List[Dict[str, Any]] = []
    notes: List[str] = []
    saved_env = dict(os.environ)
    try:
        sources = {}
        for s in sizes:
            sources[s] = make_checkpoint(os.path.join(scratch, f"src-{s}"), s * MB)
        for name in backends:
            if name == "local":
                uri = os.path.join(scratch, "local-store")
            elif name == "s3":
                from raylastic.testing.seaweedfs import SeaweedS3

                s3 = SeaweedS3(bucket="raylastic-bench").start()
                servers.append(s3)
                os.environ.update(s3.env())
                uri = s3.uri("bench")
            elif name == "azure":
                from raylastic.testing.azurite import Azurite

                az = Azurite().start()
                servers.append(az)
                os.environ["AZURE_STORAGE_CONNECTION_STRING"] = az.connection_string
                uri = "abfs://bench/ckpt"
            else:
                raise SystemExit(f"unknown backend {name!r} (local, s3, azure)")
            print(f"{name}: {uri}", flush=True)
            rows += bench_backend(name, uri, sources, reps, scratch)
    finally:
        for srv in servers:
            srv.close()
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(scratch, ignore_errors=True)

    missed = [r for r in rows if not (r["meets_stall_target"] and r["meets_throughput_target"])]
    if any(not r["meets_stall_target"] for r in rows):
        per100 = statistics.median(r["stage_s"] / r["size_mb"] * 100 for r in rows)
        notes.append(f"async stall = staging: a full local copy + CRC32 of the checkpoint on the "
                     f"training thread (median {per100:.3f} s per 100 MB in this run). It scales with "
                     "the checkpoint size, so async/sync is roughly upload speed / local copy speed: "
                     "a few % against a ~150-200 MB/s store, tens of % on local storage, where the "
                     "'upload' is itself a local copy.")
    if any(not r["meets_throughput_target"] for r in rows if r["backend"] == "local"):
        notes.append("local: Storage.upload_dir copies the files one after another (temp file + "
                     "os.replace), copy_files uses a thread pool; both are page-cache copies here "
                     "(GB/s), so the gap is a few tens of ms even at 500 MB.")
    if any(not r["meets_throughput_target"] for r in rows if r["backend"] != "local"):
        notes.append("remote: compare uploader_MBps with upload_dir_direct_MBps (the same seam on "
                     "unstaged files) to tell the seam's own cost from staging's (the staged copy "
                     "is written back to disk while it uploads).")
    notes.append("2 shared CPU cores, servers on the same machine: run-to-run spread is +-20 %; "
                 "the samples are in each row.")
    result = {
        "benchmark": "checkpoint_io",
        "ts": time.time(),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                    "cpus": os.cpu_count(), "pyarrow": pyarrow.__version__},
        "setup": {"files_per_checkpoint": NUM_FILES, "MB": MB, "sizes_mb": sizes, "reps": reps,
                  "servers": "SeaweedFS (weed server, 1 volume) and Azurite 3.35 (in-memory) on 127.0.0.1",
                  "stall": "time of Session.report(checkpoint=...) on the calling thread",
                  "uploader_throughput": "bytes / background upload time of the staged dir",
                  "raw_throughput": "bytes / pyarrow.fs.copy_files(use_threads=True) time"},
        "targets": {"async_stall_over_sync_stall_max": TARGET_STALL_RATIO,
                    "uploader_over_raw_throughput_min": TARGET_THROUGHPUT_RATIO},
        "results": rows,
        "all_targets_met": not missed,
        "notes": notes,
        "wall_s": round(time.perf_counter() - t_all, 1),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print()
    print(markdown(rows))
    print(f"\nwrote {args.out} in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
