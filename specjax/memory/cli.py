"""`specjax memory list|show|prune`: look at and tidy the search loop's memory store."""

from __future__ import annotations

import json
from pathlib import Path

from specjax.memory.store import MemoryRecordError, MemoryStore

DEFAULT_STORE = "memory_store"


def _open(args) -> MemoryStore:
    # A mistyped --store would otherwise read as an empty store; a missing records/ inside an existing
    # store directory is just a store nothing was written to yet.
    if not Path(args.store).is_dir():
        raise MemoryRecordError(f"{args.store}: memory store directory not found")
    return MemoryStore(args.store)


def _delta_text(delta: dict) -> str:
    if not delta:
        return "(stock)"
    return " ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in sorted(delta.items()))


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    # The last column (config delta) is free length, so it is not padded.
    lines = ["  ".join([c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def cmd_list(args) -> int:
    store = _open(args)
    good, bad = store.records()
    if good:
        rows = [["id", "created", "spec", "target", "hardware", "speedup meas/pred", "config delta"]]
        for r in good:
            rows.append([r.record_id, r.created, r.spec_name, str(r.deployment["target"]),
                         str(r.deployment["hardware"]),
                         f"{r.measured['speedup']:.2f}x/{r.predicted['speedup']:.2f}x",
                         _delta_text(r.config_delta)])
        print(_table(rows))
    for path, reason in bad:
        print(f"CORRUPT {path}: {reason}")
    print(f"{len(good)} records, {len(bad)} corrupt files in {store.dir}"
          + (" (`specjax memory prune --remove-corrupt` deletes them)" if bad else ""))
    return 1 if bad else 0  # corrupt files are listed, not fatal, but scripts should notice them


def cmd_show(args) -> int:
    print(json.dumps(_open(args).get(args.id).to_json_dict(), indent=2, sort_keys=True))
    return 0


def cmd_prune(args) -> int:
    if args.keep_best is None and args.older_than_days is None and not args.remove_corrupt:
        raise MemoryRecordError("memory prune: give at least one of --keep-best, --older-than-days, "
                                "--remove-corrupt")
    removed = _open(args).prune(keep_best_per_deployment=args.keep_best,
                                older_than_days=args.older_than_days,
                                remove_corrupt=args.remove_corrupt, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for p in removed:
        print(f"{verb} {p}")
    print(f"{verb} {len(removed)} files" + (" (dry run)" if args.dry_run else ""))
    return 0


def add_memory_parser(subparsers) -> None:
    m = subparsers.add_parser("memory", help="list, show or prune the search loop's memory of validated "
                                             "mechanism sets")
    sub = m.add_subparsers(dest="memory_command", required=True)

    def with_store(p):
        p.add_argument("--store", default=DEFAULT_STORE, metavar="DIR",
                       help=f"memory store directory (default {DEFAULT_STORE})")
        return p

    p = with_store(sub.add_parser("list", help="one line per record; corrupt files listed as such "
                                               "(exit code 1 if there are any)"))
    p.set_defaults(func=cmd_list)
    p = with_store(sub.add_parser("show", help="print one record as JSON"))
    p.add_argument("id", help="record id (16 hex characters, as `memory list` shows)")
    p.set_defaults(func=cmd_show)
    p = with_store(sub.add_parser("prune", help="remove records and corrupt files"))
    p.add_argument("--keep-best", type=int, metavar="N",
                   help="keep only the N best measured speedups of each deployment")
    p.add_argument("--older-than-days", type=float, metavar="D",
                   help="remove records created over D days ago")
    p.add_argument("--remove-corrupt", action="store_true",
                   help="remove files that fail verification and temp files of interrupted writes")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.set_defaults(func=cmd_prune)
