"""NVIDIA Dynamo (1.6.1): tract's vLLM connector in Dynamo's P/D mode.

Dynamo's vLLM workers (``python -m dynamo.vllm``) take vLLM's own
``--kv-transfer-config``, so ``"kv_connector": "TractConnector",
"kv_connector_module_path": "tract.integrations.vllm"`` loads tract in
aggregated mode as it does in vLLM.  In P/D mode (``--disaggregation-mode
prefill`` / ``decode``) the prefill handler asks
``dynamo.vllm.kv_connector_protocols.make_kv_connector_protocol`` how the
connector coordinates a hand-off, per request, and that function knows
only the connectors in its module-level ``KV_CONNECTOR_PROTOCOLS`` (NIXL,
Mooncake, LMCache MP): any other name is a ``ValueError``.  1.6.1 has no
registration point (no entry-point group, option or variable), so
`register` adds one entry to that dict, in the process it runs in:

    KV_CONNECTOR_PROTOCOLS["TractConnector"] = TractConnectorProtocol

a cache-mediated protocol, like LMCache MP's: the prefill request carries
no transfer parameters, and the decode request an empty set (the prefill
router wants the envelope): the decode worker's connector finds the
prompt's blocks in the pool by their block hashes, as any tract consumer
does.  Nothing else in Dynamo is changed, and an entry already there (a
later Dynamo that knows tract) is left as it is.

`register` runs as a vLLM general plugin (the ``vllm.general_plugins``
entry point ``tract_dynamo`` in tract's package metadata): vLLM loads
every general plugin in each of its processes, Dynamo's worker included,
before it reads the engine's arguments.  Where Dynamo is not installed it
does nothing.  The upstream change that would make it unnecessary: Dynamo
resolving a connector's protocol from the connector class itself (say, a
``dynamo_pd_protocol`` attribute on the class that
``kv_connector_module_path`` names), or an entry-point group for
protocols.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any

__all__ = ["CONNECTOR", "PROTOCOLS_MODULE", "protocol_class", "register"]

log = logging.getLogger(__name__)

CONNECTOR = "TractConnector"
PROTOCOLS_MODULE = "dynamo.vllm.kv_connector_protocols"


def protocol_class(base: type) -> type:
    """tract's protocol over Dynamo's ``KvConnectorProtocol`` ``base``:
    cache-mediated, no parameters either way."""

    class TractConnectorProtocol(base):
        """Cache-mediated: the prefill worker's connector stores the
        prompt's blocks in the rack's pool, and the decode worker's finds
        them by block hash; no per-request parameters cross (a block
        missing, evicted or corrupt is recomputed by the decode worker)."""

        produces_kv_transfer_params = False

        def prefill_request_kv_transfer_params(self) -> dict[str, Any]:
            return {}

        def decode_request_kv_transfer_params(self, prefill_response: Any) -> dict[str, Any]:
            return {}  # empty, not None: the prefill router wants the envelope

    return TractConnectorProtocol


def register(module: Any = None) -> bool:
    """Make Dynamo's P/D resolve ``TractConnector`` to
    `protocol_class` in this process; True when it does (now or already).
    ``module``: Dynamo's protocols module (imported when None; where
    Dynamo is not installed, nothing is done and False returned)."""
    if module is None:
        if importlib.util.find_spec("dynamo") is None:
            return False
        try:
            module = importlib.import_module(PROTOCOLS_MODULE)
        except ImportError as error:  # Dynamo without its vLLM backend, or another layout
            log.debug("tract: no Dynamo protocols to register with (%s)", error)
            return False
    registry = getattr(module, "KV_CONNECTOR_PROTOCOLS", None)
    base = getattr(module, "KvConnectorProtocol", None)
    if not isinstance(registry, dict) or not isinstance(base, type):
        log.warning("tract: %s has no KV_CONNECTOR_PROTOCOLS dict and KvConnectorProtocol "
                    "class (a Dynamo other than 1.6.1?); its P/D mode will refuse %s",
                    getattr(module, "__name__", module), CONNECTOR)
        return False
    registry.setdefault(CONNECTOR, protocol_class(base))
    return True
