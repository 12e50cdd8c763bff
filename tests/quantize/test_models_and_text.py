"""Text preparation (unit) and the real cached models/texts (slow, skipped when not cached)."""
import json

import pytest
import torch

from vllm_mixprec.quantize import models


def test_prepare_text_strips_bom_crlf_and_gutenberg():
    raw = ("\ufeffThe Project Gutenberg EBook of X\r\n\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\n"
           "Chapter 1\r\nHello.\r\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\r\nLicense text\r\n")
    out = models.prepare_text(raw)
    assert out == "Chapter 1\nHello.\n"


def test_prepare_text_leaves_plain_text_alone():
    assert models.prepare_text("abc\ndef") == "abc\ndef\n"


def test_unknown_names():
    with pytest.raises(models.FetchError):
        models.fetch_model("gpt-5")
    with pytest.raises(models.FetchError):
        models.load_text("no-such-text-or-file")


def test_fix_config_adds_legacy_keys(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"rope_parameters": {"rope_theta": 1e5}, "dtype": "bfloat16"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    models.fix_config(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["rope_theta"] == 1e5 and cfg["torch_dtype"] == "bfloat16"
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def _need(path):
    if path is None:
        pytest.skip("not cached: run `vllm-mixprec fetch smollm2-135m text` first")
    return path


@pytest.mark.slow
def test_cached_texts_are_pinned_and_disjoint():
    for name, src in models.TEXTS.items():
        p = _need(models.cached_text(name))
        assert models.sha256_file(p) == src.sha256
    bot = models.load_text("botchan")
    assert "\ufeff" not in bot and "\r" not in bot and "PROJECT GUTENBERG" not in bot.upper()[:2000]
    calib = models.load_text(models.CALIBRATION_TEXT)
    assert models.CALIBRATION_TEXT not in models.EVAL_TEXTS
    assert calib[:5000] not in models.load_text("lcet10")


@pytest.mark.slow
def test_smollm2_w4a8_quantizes_and_stays_close(tmp_path):
    from transformers import AutoTokenizer

    from vllm_mixprec.eval import perplexity as P
    from vllm_mixprec.quantize.pipeline import QuantOptions, quantize_model

    src = _need(models.cached_model("smollm2-135m"))
    _need(models.cached_text("alice29"))
    torch.set_num_threads(1)
    opts = QuantOptions(smooth=True, calib_samples=4, calib_seqlen=256, propagate="float", progress=False)
    out = quantize_model(src, tmp_path / "q", opts)["output"]
    ids = P.tokenize(AutoTokenizer.from_pretrained(src), models.load_text("lcet10"))
    base, _ = P.load_model_cpu(src)
    quant, kind = P.load_model_cpu(out)
    assert kind == "mixprec"
    p0 = P.perplexity_cpu(base, ids, 1024, 1024)["ppl"]
    p1 = P.perplexity_cpu(quant, ids, 1024, 1024)["ppl"]
    assert 20 < p0 < 60 and p1 < 1.6 * p0
