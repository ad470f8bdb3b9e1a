"""The `tract` command: `tract info`, `tract bench NAME`, `tract demo`."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _info(args: argparse.Namespace) -> int:
    from tract.platform import info

    report = info()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    control = report["cache_control"]
    print(f"cpu            {report['cpu_model']} ({report['machine']}, {report['build_path']} build)")
    print(f"flush avail.   {', '.join(report['flush_available']) or 'none'}")
    print(f"chosen         {control['chosen']} ({control['source']}): flush={control['flush']} "
          f"invalidate={control['invalidate']} writeback={control['writeback']} "
          f"fence={control['fence']}")
    print(f"non-temporal   {report['nontemporal_copy']}")
    print(f"coherence      {report['default_coherence']} (default for every pool)")
    for node in report["numa_nodes"]:
        cpus = f"{len(node['cpus'])} cpus" if node["cpus"] else "no cpus (memory only)"
        print(f"numa node {node['node']:<4} {cpus}, {(node['mem_bytes'] or 0) >> 20} MiB")
    for dax in report["dax_devices"] or [{"path": "none found"}]:
        extra = f" {dax['size']} bytes, align {dax['align']}, numa {dax['numa_node']}" \
            if "size" in dax else ""
        print(f"dax            {dax['path']}{extra}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from tract import bench

    if args.list or not args.name:
        print("\n".join(sorted(bench.BENCHMARKS)))
        return 0 if args.list else 2
    if args.name not in bench.BENCHMARKS:
        print(f"tract bench: unknown benchmark {args.name!r}; known: "
              f"{', '.join(sorted(bench.BENCHMARKS))}", file=sys.stderr)
        return 2
    report = bench.run(args.name, quick=args.quick)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"tract bench {args.name} on {report['machine']['cpu_model']}")
    for result in report["results"]:
        ratio = "" if result["ratio"] is None else \
            f"  {result['ratio']:6.2f}x vs {result['baseline']} ({result['baseline_value']:.4g})"
        print(f"  {result['name']:<44} {result['value']:12.4g} {result['unit'].split(',')[0]:<18}{ratio}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from tract import demo

    return demo.main(quick=args.quick, as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tract", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="CPU, cache-control choice, NUMA and DAX devices")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(handler=_info)

    bench = commands.add_parser("bench", help="run a benchmark against same-run baselines")
    bench.add_argument("name", nargs="?", help="benchmark name (see --list)")
    bench.add_argument("--list", action="store_true", help="list the benchmarks")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    bench.set_defaults(handler=_bench)

    demo = commands.add_parser("demo", help="show a pool shared by two processes")
    demo.add_argument("--quick", action="store_true", help="a smaller run")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(handler=_demo)

    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
