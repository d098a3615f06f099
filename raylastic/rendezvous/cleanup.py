"""Delete old runs from the azure-table rendezvous table (Azure Tables have no native TTL).

    python -m raylastic.rendezvous.cleanup --endpoint https://<account>.table.core.windows.net \\
        --older-than 7d [--dry-run]
    python -m raylastic.rendezvous.cleanup --endpoint ... --run-id <rdzv-id>

A run is one partition (rendezvous state + control-plane keys). ``--older-than`` deletes every
rendezvous partition whose newest entity is older than the cutoff: a live run's state entity is
rewritten by each keep-alive heartbeat, so live runs are never touched. ``--run-id`` queries and
deletes that run's partition only. Only what this backend writes is ever deleted: partitions named
``run-<id>``/``runh-<hash>`` holding nothing but its rows (``state``, ``kv-*``, ``kvh-*``); any
other partition or row in a shared table is left alone (a partition that mixes in foreign rows is
skipped whole, with a line saying so). Credentials are found as for torchrun
(docs/torchrun_azure.md); nothing secret is printed.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections import defaultdict
from datetime import datetime, timedelta, timezone
from typing import Any, Optional, Sequence

from raylastic.rendezvous._endpoint import parse_endpoint, resolve_credential
from raylastic.rendezvous._table import TableOps, partition_key

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> timedelta:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"2w"`` -> timedelta."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age like 7d, 12h, 30m, 90s or 2w")
    return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


_OUR_PARTITION = re.compile(r"run-[A-Za-z0-9._:@=+-]{1,200}|runh-[0-9a-f]{40}")
_OUR_ROW = re.compile(r"state|kv-[A-Za-z0-9_-]*|kvh-[0-9a-f]{64}")
_SELECT = ["PartitionKey", "RowKey", "RunId", "Timestamp"]


def is_rendezvous_row(pk: str, rk: str) -> bool:
    """Whether (PartitionKey, RowKey) has the shape this backend writes (``partition_key``,
    the state row, ``AzureTableStore`` keys)."""
    return _OUR_PARTITION.fullmatch(pk or "") is not None and _OUR_ROW.fullmatch(rk or "") is not None


def _partitions(ops: TableOps, pk: Optional[str] = None) -> dict:
    """PartitionKey -> (row keys, newest timestamp, run id if known); only partition ``pk``
    (a query on that partition) when given, else a scan of the table."""
    rows: dict = defaultdict(list)
    newest: dict = {}
    run_ids: dict = {}

    def entities():
        if pk is None:
            return ops.client.list_entities(select=_SELECT)
        return ops.client.query_entities("PartitionKey eq @pk", parameters={"pk": pk}, select=_SELECT)

    def scan() -> None:
        for found in (rows, newest, run_ids):  # a retried scan starts over
            found.clear()
        for entity in entities():
            key = entity["PartitionKey"]
            rows[key].append(entity["RowKey"])
            stamp = entity.metadata.get("timestamp")
            if stamp is not None and (key not in newest or stamp > newest[key]):
                newest[key] = stamp
            if entity.get("RunId"):
                run_ids[key] = entity["RunId"]

    ops.call("list_entities" if pk is None else "query_entities", scan)
    return {key: (rows[key], newest.get(key), run_ids.get(key, key)) for key in rows}


def _submit(ops: TableOps, batch: list) -> Any:
    return ops.client.submit_transaction(batch)


def _delete_partition(ops: TableOps, pk: str, row_keys: list) -> None:
    # One transaction holds at most 100 operations on one partition.
    for i in range(0, len(row_keys), 100):
        batch = [("delete", {"PartitionKey": pk, "RowKey": rk}) for rk in row_keys[i : i + 100]]
        ops.call("delete run", functools.partial(_submit, ops, batch))


def cleanup(
    ops: TableOps,
    *,
    older_than: Optional[timedelta] = None,
    run_id: Optional[str] = None,
    dry_run: bool = False,
    now: Optional[datetime] = None,
    out=None,
) -> list:
    """Delete matching runs (printing one line each to ``out``, default stdout); return their ids."""
    out = out or sys.stdout
    if (older_than is None) == (run_id is None):
        raise ValueError("give exactly one of older_than and run_id")
    cutoff = (now or datetime.now(timezone.utc)) - older_than if older_than is not None else None
    wanted = partition_key(run_id) if run_id is not None else None
    deleted = []
    for pk, (row_keys, newest, rid) in sorted(_partitions(ops, wanted).items()):
        if wanted is not None and pk != wanted:
            continue
        foreign = [rk for rk in row_keys if not is_rendezvous_row(pk, rk)]
        if foreign:
            if wanted is not None or _OUR_PARTITION.fullmatch(pk):
                print(
                    f"skipping partition {pk!r}: {len(foreign)} of its rows were not written by the "
                    f"azure-table rendezvous (e.g. {foreign[0]!r})",
                    file=out,
                )
            continue
        if cutoff is not None and (newest is None or newest >= cutoff):
            continue  # fresh, or of unknown age: never guess towards deleting
        age = f"last active {newest:%Y-%m-%d %H:%M} UTC" if newest else "age unknown"
        print(f"{'would delete' if dry_run else 'deleting'} run {rid!r}: {len(row_keys)} entities, {age}", file=out)
        if not dry_run:
            _delete_partition(ops, pk, row_keys)
        deleted.append(rid)
    return deleted


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raylastic.rendezvous.cleanup", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--endpoint", required=True, help="the torchrun --rdzv-endpoint (account or table URL)")
    parser.add_argument("--table", default=None, help="table name if not in the endpoint (default torchrendezvous)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--older-than", type=parse_age, help="delete runs idle for longer than this (7d, 12h)")
    which.add_argument("--run-id", help="delete this run (its --rdzv-id)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be deleted")
    args = parser.parse_args(argv)
    try:
        endpoint = parse_endpoint(args.endpoint, args.table)
        credential, _ = resolve_credential(endpoint)
        ops = TableOps(endpoint, credential)
        deleted = cleanup(ops, older_than=args.older_than, run_id=args.run_id, dry_run=args.dry_run)
    except Exception as exc:  # noqa: BLE001 - a CLI: one clear line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{len(deleted)} run(s) {'matched' if args.dry_run else 'deleted'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
