"""`tract.integrations.dynamo`: Dynamo's P/D protocol registry learns
TractConnector, on a stand-in of Dynamo 1.6.1's
``dynamo.vllm.kv_connector_protocols`` (its registry dict, its abstract
base and its resolver, as the wheel has them); the Dynamo tier runs it on
the real module."""

import abc
import types

import pytest

from tract.integrations import dynamo


def _stand_in():
    """The shape of Dynamo 1.6.1's protocols module."""
    module = types.ModuleType("kv_connector_protocols")

    class KvConnectorProtocol(abc.ABC):
        produces_kv_transfer_params = True

        def __init__(self, vllm_config):
            self._vllm_config = vllm_config

        @abc.abstractmethod
        def prefill_request_kv_transfer_params(self):
            pass

        @abc.abstractmethod
        def decode_request_kv_transfer_params(self, prefill_response):
            pass

    class Nixl(KvConnectorProtocol):
        def prefill_request_kv_transfer_params(self):
            return {"do_remote_decode": True}

        def decode_request_kv_transfer_params(self, prefill_response):
            return prefill_response

    registry = {"NixlConnector": Nixl}

    def make_kv_connector_protocol(vllm_config):
        name = vllm_config.kv_transfer_config.kv_connector
        if name not in registry:
            raise ValueError(f"Unsupported kv_connector={name!r} for PD")
        return registry[name](vllm_config)

    module.KvConnectorProtocol, module.KV_CONNECTOR_PROTOCOLS = KvConnectorProtocol, registry
    module.make_kv_connector_protocol = make_kv_connector_protocol
    return module


def _config(name):
    return types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector=name))


def test_tract_resolves_to_a_cache_mediated_protocol_once_registered():
    module = _stand_in()
    with pytest.raises(ValueError, match="Unsupported kv_connector='TractConnector'"):
        module.make_kv_connector_protocol(_config("TractConnector"))
    assert dynamo.register(module) is True
    protocol = module.make_kv_connector_protocol(_config("TractConnector"))
    assert isinstance(protocol, module.KvConnectorProtocol)
    assert protocol.produces_kv_transfer_params is False
    assert protocol.prefill_request_kv_transfer_params() == {}
    assert protocol.decode_request_kv_transfer_params({"anything": 1}) == {}
    assert set(module.KV_CONNECTOR_PROTOCOLS) == {"NixlConnector", "TractConnector"}
    assert module.make_kv_connector_protocol(_config("NixlConnector")) \
        .prefill_request_kv_transfer_params() == {"do_remote_decode": True}


def test_an_entry_already_there_is_kept_and_registering_twice_changes_nothing():
    module = _stand_in()
    theirs = type("Theirs", (module.KvConnectorProtocol,), {
        "prefill_request_kv_transfer_params": lambda self: {"theirs": True},
        "decode_request_kv_transfer_params": lambda self, response: None})
    module.KV_CONNECTOR_PROTOCOLS["TractConnector"] = theirs
    assert dynamo.register(module) is True and dynamo.register(module) is True
    assert module.KV_CONNECTOR_PROTOCOLS["TractConnector"] is theirs


def test_another_layout_is_left_alone_with_a_warning(caplog):
    other = types.ModuleType("kv_connector_protocols")
    other.KV_CONNECTOR_PROTOCOLS = ("not", "a", "dict")
    with caplog.at_level("WARNING", logger="tract.integrations.dynamo"):
        assert dynamo.register(other) is False
    assert "its P/D mode will refuse TractConnector" in caplog.text
    assert other.KV_CONNECTOR_PROTOCOLS == ("not", "a", "dict")


def test_without_dynamo_installed_nothing_is_imported_or_done(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "dynamo" else real(name, *a))
    assert dynamo.register() is False


def test_the_package_declares_the_vllm_general_plugin():
    import pathlib
    import tomllib

    project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    plugins = project["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"tract_dynamo": "tract.integrations.dynamo:register"}
