"""`tract demo --engine vllm` (`tract.demo_vllm`) without vLLM: its model
directory, its report and table from recorded results, its reading of
vLLM's metrics, and its refusals.  `make demo-vllm` runs it on vLLM."""

import pytest

from tract import cli, demo_vllm
from tract.errors import ConfigError


def test_the_model_directory_has_a_tokenizer_that_round_trips_token_ids(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoTokenizer

    config = demo_vllm.VllmDemoConfig(vocab=64, layers=1, hidden=64, heads=2, kv_heads=1,
                                      intermediate=64, lengths=(32,))
    target = demo_vllm.make_model_dir(config, str(tmp_path / "model"))
    tokenizer = AutoTokenizer.from_pretrained(target)
    ids = [5, 63, 3, 17, 1, 0]
    assert tokenizer.decode(ids) == "t5 t63 t3 t17 <s> <unk>"
    assert tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] == ids
    model = AutoConfig.from_pretrained(target)
    assert (model.vocab_size, model.num_key_value_heads, model.max_position_embeddings) \
        == (64, 1, config.max_model_len)


def test_prompts_take_the_lengths_in_turn_and_no_special_token():
    config = demo_vllm.VllmDemoConfig(requests=5, lengths=(40, 70))
    batch = demo_vllm.prompts(config)
    assert [len(p) for p in batch] == [40, 70, 40, 70, 40]
    assert min(min(p) for p in batch) >= 3 and batch == demo_vllm.prompts(config)


def test_load_seconds_are_summed_over_engines_from_the_exposition():
    text = "\n".join([
        "# HELP vllm:tract_load_seconds tract: seconds a load took, queueing included",
        'vllm:tract_load_seconds_bucket{engine="0",le="0.01"} 3.0',
        'vllm:tract_load_seconds_sum{engine="0"} 0.25',
        'vllm:tract_load_seconds_count{engine="0"} 4.0',
        'vllm:tract_load_seconds_sum{engine="1"} 0.5',
        'vllm:tract_load_seconds_count{engine="1"} 1.0',
        'vllm:tract_save_seconds_sum{engine="0"} 9.0'])
    assert demo_vllm._load_seconds(text) == (0.75, 5)
    assert demo_vllm._load_seconds("") == (0.0, 0)


def _results(texts, ttfts):
    return [{"text": text, "ttft_s": ttft, "seconds": ttft + 0.1}
            for text, ttft in zip(texts, ttfts)]


def test_the_report_pairs_each_arm_with_tract_prompt_by_prompt_and_checks_the_tokens():
    config = demo_vllm.VllmDemoConfig(requests=3, lengths=(65,), layers=2, block=32)
    batch = demo_vllm.prompts(config)
    results = {"tract": _results("abc", [0.1, 0.2, 0.4]),
               "example_connector": _results("abc", [0.2, 0.2, 0.2]),
               "vllm": _results("abc", [0.3, 0.1, 0.8])}
    counters = {demo_vllm.DECODE_NODE: {"hit_blocks": 6, "read_bytes": 99}}
    report = demo_vllm._report(config, "0.32.0", batch, results, (1.5, 13), (0.5, 3),
                               counters, 42.0, lambda nbytes: nbytes * 1e-10)
    assert report["token_exact"] is True
    assert report["arms"]["example_connector"]["ttft_over_tract"] == \
        pytest.approx({"median": 1.0, "min": 0.5, "max": 2.0})
    assert report["arms"]["vllm"]["ttft_over_tract"] == \
        pytest.approx({"median": 2.0, "min": 0.5, "max": 3.0})
    block_bytes = 2 * 2 * config.kv_heads * 64 * 32 * 4
    load = report["tract_load"]
    assert load["loads"] == 10 and load["mean_s"] == pytest.approx(0.1)
    assert load["bytes_per_request"] == 2 * block_bytes  # every token but the last: 2 blocks
    assert load["of_bound"] == pytest.approx(2 * block_bytes * 1e-10 / 0.1)
    assert report["decode_counters"]["hit_blocks"] == 6
    text = demo_vllm.table(report)
    for label in ("tract (P/D)", "ExampleConnector (P/D)", "vLLM, no connector",
                  "token_exact: True", "0.32.0", "1.00 [0.50-2.00]"):
        assert label in text
    results["vllm"][1]["text"] = "x"
    assert demo_vllm._report(config, "0.32.0", batch, results, (0, 0), (0, 0), {}, 1.0,
                             lambda nbytes: 1.0)["token_exact"] is False


def test_an_interpreter_without_vllm_and_flags_of_the_other_demo_are_refused_by_name(capsys):
    import importlib.util
    import sys

    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match="cannot import vllm"):
            demo_vllm.run(demo_vllm.VllmDemoConfig(python=sys.executable), progress=False)
    assert cli.main(["demo", "--vllm-python", sys.executable]) == 2
    assert "--vllm-python is for --engine vllm" in capsys.readouterr().err
    assert cli.main(["demo", "--engine", "vllm", "--experiment", "static"]) == 2
    assert "the tract engine's" in capsys.readouterr().err
