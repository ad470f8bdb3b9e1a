"""Wall time of each tier of ``make test``.

    python tests/tiers.py run NAME -- COMMAND...   # run it; record its time and exit status
    python tests/tiers.py report                   # print the table; write out/test-times.json
    python tests/tiers.py wait NAME                # until tier NAME has run; exit with its status

``run`` exits with the command's status (pytest's 5, "no tests collected",
counts as a pass: a marker tier may be empty).  ``report`` prints every tier
recorded since ``make test`` began, passed or failed, and exits 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

OUT = Path("out")
RECORDS = OUT / "tiers"


def run(name: str, command: list[str]) -> int:
    RECORDS.mkdir(parents=True, exist_ok=True)
    started, wall = time.time(), time.monotonic()
    status = subprocess.call(command)
    if status == 5 and Path(command[0]).name.startswith("python") and "pytest" in command:
        status = 0
    record = RECORDS / f"{name}.json"
    if record.exists():  # run again in this `make test` (a prerequisite met already):
        return status     # the first run's time is the tier's
    record.write_text(json.dumps(
        {"tier": name, "seconds": round(time.monotonic() - wall, 1), "status": status,
         "started": started}) + "\n")
    return status


def report() -> int:
    records = sorted((json.loads(path.read_text()) for path in RECORDS.glob("*.json")),
                     key=lambda record: record["started"])
    if not records:
        print("no tier ran")
        return 0
    first = records[0]["started"]
    last = max(record["started"] + record["seconds"] for record in records)
    width = max(len(record["tier"]) for record in records)
    print(f"\n{'tier':<{width}}  {'seconds':>8}  {'start':>6}  result")
    for record in records:
        result = "ok" if record["status"] == 0 else f"FAILED ({record['status']})"
        print(f"{record['tier']:<{width}}  {record['seconds']:>8.1f}  "
              f"{record['started'] - first:>6.0f}  {result}")
    total = round(last - first, 1)
    print(f"{'total (wall, tiers overlap)':<{width}}  {total:>8.1f}")
    OUT.mkdir(exist_ok=True)
    (OUT / "test-times.json").write_text(json.dumps(
        {"total_seconds": total, "tiers": [{key: record[key] for key in ("tier", "seconds", "status")}
                                           | {"start": round(record["started"] - first, 1)}
                                           for record in records]}, indent=2) + "\n")
    return 0


def wait(name: str, poll: float = 5.0) -> int:
    """Wait until tier ``name`` (of the other lane) has been recorded; its
    status.  The lane that runs it always runs it, passed or failed."""
    record = RECORDS / f"{name}.json"
    while not record.exists():
        time.sleep(poll)
    return json.loads(record.read_text())["status"]


def main(argv: list[str]) -> int:
    if argv[:1] == ["report"]:
        return report()
    if len(argv) == 2 and argv[0] == "wait":
        return wait(argv[1])
    if len(argv) >= 3 and argv[0] == "run" and argv[2] == "--":
        return run(argv[1], argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
