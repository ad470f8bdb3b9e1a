"""SGLang 0.5.23's own host KV pools and HiCache storage plumbing with
tract's backend, for the real-package tier (`make test-sglang`), and a
child-process entry point (``python sgl_engine.py put|get POOL NODE SEED
KIND LAYOUT``) so two SGLang hosts on two node ids share one pool.

Pools are real: a device pool on ``device="cpu"``, the host pool SGLang
builds from its buffer info, page keys from SGLang's own page hash; page
bytes are seeded from the page's key.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the CUDA build of torch: look for no GPU
warnings.filterwarnings("ignore", message=".*(AWQ|GGUF|CUDA).*")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

PAGE, LAYERS, DTYPE = 4, 3, torch.bfloat16
MODEL = "tiny/llama"
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def device_pool(kind: str, tokens: int = 64):
    if kind == "mha":
        return MHATokenToKVPool(tokens, PAGE, DTYPE, head_num=2, head_dim=8, layer_num=LAYERS,
                                device="cpu", enable_memory_saver=False, start_layer=0,
                                end_layer=LAYERS - 1)
    return MLATokenToKVPool(tokens, PAGE, DTYPE, kv_lora_rank=12, qk_rope_head_dim=4,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                            start_layer=0, end_layer=LAYERS - 1)


def host_pool(kind: str, layout: str, device=None):
    device = device or device_pool(kind)
    info = device.get_device_pool_infos()[0].buffer_info
    common = dict(device_capacity_tokens=device.size, start_layer=device.start_layer,
                  end_layer=device.end_layer)
    if kind == "mha":
        return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                    write_back_staging=device.hicache_write_back_staging,
                                    **common)
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                override_kv_cache_dim=device.kv_cache_dim,
                                target_layer_num=device.layer_num, **common)


def extra_config(pool: str, node: int, **more) -> dict:
    return {"backend_name": "tract", "module_path": "tract.integrations.sglang",
            "class_name": "TractHiCacheStorage", "interface_v1": 1, "pool": pool,
            "node": node, "manager": True, **more}


def storage_config(pool: str, node: int, kind: str, layout: str, tp_rank: int = 0,
                   tp_size: int = 1, metrics: bool = False, **more) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                attn_cp_rank=0, attn_cp_size=1, is_mla_model=kind == "mla",
                                enable_storage_metrics=metrics,
                                is_page_first_layout=layout == "page_first", model_name=MODEL,
                                extra_config=extra_config(pool, node, **more))


def backend(pool: str, node: int, kind: str, layout: str, host=None, **config):
    """SGLang's dynamic loader's backend, registered a host pool (as its
    cache controller does)."""
    made = StorageBackendFactory.create_backend(
        "dynamic", storage_config(pool, node, kind, layout, **config), None)
    made.register_mem_pool_host(host if host is not None else host_pool(kind, layout))
    return made


def page_keys(seed: int, pages: int) -> tuple[list[int], list[str]]:
    """Seeded prompt tokens and SGLang's own page keys of them."""
    from sglang.srt.mem_cache.utils import get_hash_str

    tokens = np.random.default_rng(seed).integers(0, 32000, pages * PAGE).tolist()
    return tokens, get_hash_str(tokens, None, page_size=PAGE)


def page_bytes(host, key: str) -> torch.Tensor:
    """The flat page a page of ``key`` holds (seeded from the key)."""
    shape = host.get_dummy_flat_data_page().shape
    rng = np.random.default_rng(int(key[:15], 16))
    return torch.from_numpy(rng.standard_normal(tuple(shape), dtype=np.float32)).to(host.dtype)


def fill(host, keys: list[str]) -> torch.Tensor:
    """Host slots holding the pages of ``keys``, written through SGLang's
    own flat-page setter."""
    slots = host.alloc(len(keys) * PAGE)
    for page, key in enumerate(keys):
        host.set_from_flat_data_page(int(slots[page * PAGE]), page_bytes(host, key))
    return slots


def exact(host, keys: list[str], slots) -> list[bool]:
    return [torch.equal(host.get_data_page(int(slots[page * PAGE]), flat=True),
                        page_bytes(host, key)) for page, key in enumerate(keys)]


def main(argv: list[str]) -> None:
    mode, pool, node, seed, kind, layout = argv[0], argv[1], int(argv[2]), int(argv[3]), \
        argv[4], argv[5]
    host = host_pool(kind, layout)
    made = backend(pool, node, kind, layout, host)
    try:
        _, keys = page_keys(seed, 6)
        if mode == "put":
            report = {"stored": made.batch_set_v1(keys, fill(host, keys))}
        else:
            slots = host.alloc(len(keys) * PAGE)
            report = {"exists": made.batch_exists(keys),
                      "loaded": made.batch_get_v1(keys, slots),
                      "exact": exact(host, keys, slots), "node": made.pool.node}
    finally:
        made.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
