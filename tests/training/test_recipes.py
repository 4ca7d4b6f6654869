"""Better models in the same time: subword regularization, tagged back-translation and LoRA
adapters, each resumable to the byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from attnmt import Translator
from attnmt.config import AdapterConfig, SubwordSampling, from_dict
from attnmt.data.sampling import Resegmenter
from attnmt.data.store import open_store
from attnmt.data.tokenizer import BT_TAG
from attnmt.errors import CheckpointError, ConfigError
from attnmt.models.directory import load_model_dir, read_tensors
from attnmt.models.lora import attach_adapters, merge_adapters
from attnmt.models.transformer import FeedForward
from attnmt.training.loop import train

from conftest import make_pairs, tiny_config, write_lines
from helpers import random_batch, stepwise_logits, tiny_model


def resumed_equals_uninterrupted(raw: dict, tmp_path: Path) -> None:
    """Trained to step 8 at once, and to step 4 then resumed to 8: the same bytes."""
    train(from_dict(raw), tmp_path / "full", quiet=True)
    short = {**raw, "train": {**raw["train"], "max_steps": 4}}
    train(from_dict(short), tmp_path / "part", quiet=True)
    train(from_dict(raw), tmp_path / "part", resume=True, quiet=True)
    for name in ("last.safetensors", "best.safetensors"):
        assert (tmp_path / "full" / name).read_bytes() == (tmp_path / "part" / name).read_bytes()


# --- subword regularization ---


def test_sampled_segmentations_follow_seed_epoch_and_line_and_keep_the_text(
    trained: tuple[Path, dict[str, Path]],
):
    _, tokenizer, _ = load_model_dir(trained[0])
    draws = Resegmenter(tokenizer, SubwordSampling(alpha=0.1, nbest=16), seed=1, max_len=100)
    src = tokenizer.src.encode(["w1w2w3 w4w5 w6w7w8w9 w10"])[0]
    by_epoch = [draws.draw(src, 0, (1, epoch, 7, 0)) for epoch in range(12)]
    assert len({tuple(x) for x in by_epoch}) > 1  # resampled from epoch to epoch
    assert draws.draw(src, 0, (1, 3, 7, 0)) == by_epoch[3]  # the same key, the same draw
    for ids in by_epoch:  # another segmentation of the same text
        assert tokenizer.src.decode(ids) == tokenizer.src.decode(src)


def test_subword_sampling_resumes_to_the_byte(tmp_path: Path, corpus):
    raw = tiny_config(corpus)
    raw["tokenizer"]["sampling"] = {"alpha": 0.2, "nbest": 8}
    raw["train"].update(max_steps=8, eval_every=4, batch_tokens=500)  # epochs of a few steps
    resumed_equals_uninterrupted(raw, tmp_path)
    log = (tmp_path / "full" / "train_log.jsonl").read_text()
    assert '"epochs": 2' in log or '"epochs": 3' in log  # resumed across an epoch's end
    del raw["tokenizer"]["sampling"]
    train(from_dict(raw), tmp_path / "plain", quiet=True)
    best = [read_tensors(tmp_path / d / "last.safetensors")[0] for d in ("full", "plain")]
    assert any(not torch.equal(best[0][n], best[1][n]) for n in best[0])  # it was sampled


def test_subword_sampling_needs_a_unigram_model(corpus):
    raw = tiny_config(corpus)
    raw["tokenizer"].update(model_type="bpe", sampling={})
    with pytest.raises(ConfigError, match="unigram"):
        from_dict(raw)


# --- tagged back-translation ---


def test_a_synthetic_corpus_is_tagged_and_text_never_becomes_the_tag(tmp_path: Path, corpus):
    src, tgt = make_pairs(60, 5)
    synthetic = {"src": str(write_lines(tmp_path / "bt.src", src)),
                 "tgt": str(write_lines(tmp_path / "bt.tgt", tgt)), "synthetic": True}  # fmt: skip
    raw = tiny_config(corpus)
    raw["data"]["train"] = [raw["data"]["train"], synthetic]
    raw["train"].update(max_steps=2, eval_every=2)
    train(from_dict(raw), tmp_path / "m", quiet=True)
    translator = Translator.load(tmp_path / "m", device="cpu")
    bt = translator.tokenizer.bt_id()
    assert bt is not None and translator.tokenizer.src.pieces([bt]) == [BT_TAG]
    store = open_store(tmp_path / "m")
    counts = store.meta["corpus_pairs"]
    sources, _ = store.pairs(list(range(len(store))))
    assert all(ids[0] != bt for ids in sources[: counts[0]])  # the real corpus: untagged
    assert all(ids[0] == bt for ids in sources[counts[0] :])  # the synthetic one: tagged
    assert bt not in translator.tokenizer.src.encode([f"{BT_TAG} w1 w2"])[0]
    prepared = translator.prepare(["w1 w2"], translator.options(1))
    assert prepared.source_prefix == ()  # a translated source never carries it


def test_a_synthetic_corpus_needs_the_tag_in_a_given_tokenizer(tmp_path: Path, corpus):
    raw = tiny_config(corpus)
    raw["train"].update(max_steps=2, eval_every=2)
    train(from_dict(raw), tmp_path / "base", quiet=True)
    raw["data"]["train"] = {**raw["data"]["train"], "synthetic": True}
    raw["train"]["init_from"] = str(tmp_path / "base")
    with pytest.raises(ConfigError, match="no <BT> piece"):
        train(from_dict(raw), tmp_path / "ft", quiet=True)


def test_distill_samples_back_translations_and_prints_the_synthetic_entry(
    tmp_path: Path, trained, run_cli
):
    model, corpus = trained
    mono = corpus["dev_tgt"]
    outputs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.bt"
        r = run_cli("distill", "-t", str(model), "-s", str(mono), "-o", str(out), "--sampling",
                    "--top-k", "5", "--seed", "3", "--chunk-lines", "7")  # fmt: skip
        assert r.code == 0, r
        assert f"{{src: {out}, tgt: {mono}, synthetic: true}}" in r.stderr
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1]  # seeded by the lines' places
    assert len(outputs[0].splitlines()) == len(mono.read_text().splitlines())


# --- LoRA adapters ---


def test_an_adapter_at_initialisation_changes_nothing_and_merging_keeps_the_function():
    model = tiny_model("transformer").eval()
    batch = random_batch(3)
    with torch.no_grad():
        before = stepwise_logits(model, batch, batch.tgt_in)
        assert attach_adapters(model, AdapterConfig(rank=2)) == 4 * 3 * 2  # q k v o, 6 attns
        torch.testing.assert_close(stepwise_logits(model, batch, batch.tgt_in), before)
        for name, p in model.named_parameters():
            assert p.requires_grad == ("lora_" in name)
            if name.endswith("lora_b"):
                p.normal_(std=0.05)  # as if trained
        adapted = stepwise_logits(model, batch, batch.tgt_in)
        assert not torch.allclose(adapted, before)
        merge_adapters(model)
        merged = stepwise_logits(model, batch, batch.tgt_in)
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-5)


def test_feed_forward_adapters_start_as_the_base_and_learn_through_the_fused_block():
    model = tiny_model("transformer")
    batch = random_batch(3)
    with torch.no_grad():
        before = stepwise_logits(model.eval(), batch, batch.tgt_in)
        cfg = AdapterConfig(rank=2, targets=["ff1", "ff2"])
        assert attach_adapters(model, cfg) == 2 * 4  # 2 + 2 layers' blocks
        torch.testing.assert_close(stepwise_logits(model, batch, batch.tgt_in), before)
    # Training (dropout on, fp32 on the CPU): the feed-forward block's fused kernel would
    # read W_2 alone; with an adapter it computes the plain way and B gets a gradient.
    ff = next(m for m in model.modules() if isinstance(m, FeedForward))
    ff.p = 0.5
    ff.train()
    ff(torch.randn(4, 5, ff.w_1.in_features)).sum().backward()
    assert ff.w_2.lora_b.grad is not None and ff.w_2.lora_b.grad.abs().sum() > 0
    assert ff.w_2.weight.grad is None  # the base stays frozen


def adapter_config(corpus: dict[str, Path], base: Path, steps: int = 8) -> dict:
    raw = tiny_config(corpus)
    raw["train"].update(max_steps=steps, eval_every=4, init_from=str(base), lr=0.01,
                        adapters={"rank": 2, "alpha": 4, "targets": ["q", "v"]})  # fmt: skip
    return raw


@pytest.fixture
def base(tmp_path: Path, corpus) -> Path:
    raw = tiny_config(corpus)
    raw["train"].update(max_steps=6, eval_every=6)
    train(from_dict(raw), tmp_path / "base", quiet=True)
    return tmp_path / "base"


def test_adapters_train_alone_and_the_directory_keeps_only_them(tmp_path: Path, corpus, base):
    before = (base / "best.safetensors").read_bytes()
    train(from_dict(adapter_config(corpus, base)), tmp_path / "lora", quiet=True)
    assert (base / "best.safetensors").read_bytes() == before  # the base is left as it was
    stored, _, _ = read_tensors(tmp_path / "lora" / "best.safetensors")
    assert stored and all(name.endswith(("lora_a", "lora_b")) for name in stored)
    events = [json.loads(line) for line in (tmp_path / "lora" / "train_log.jsonl").open()]
    model = next(e for e in events if e["event"] == "model")
    assert model["trained_parameters"] == sum(t.numel() for t in stored.values())
    log = (tmp_path / "lora" / "train.log").read_text()
    assert f"({model['trained_parameters']:,} trained: the LoRA adapters)" in log
    _, _, merged = load_model_dir(tmp_path / "lora")
    _, _, plain = load_model_dir(base)
    changed = [
        n for n, p in merged.state_dict().items() if not torch.equal(p, plain.state_dict()[n])
    ]
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed)
    lines = Translator.load(tmp_path / "lora", device="cpu").translate(["w1 w2 w3"], beam=2)
    assert len(lines) == 1


def test_adapter_training_resumes_to_the_byte(tmp_path: Path, corpus, base):
    resumed_equals_uninterrupted(adapter_config(corpus, base), tmp_path)


def test_a_missing_or_changed_base_is_one_clear_line(tmp_path: Path, corpus, base):
    train(from_dict(adapter_config(corpus, base, steps=2)), tmp_path / "lora", quiet=True)
    moved = tmp_path / "moved"
    shutil.move(base, moved)
    with pytest.raises(CheckpointError, match="which is missing"):
        load_model_dir(tmp_path / "lora")
    shutil.move(moved, base)
    raw = tiny_config(corpus)
    raw["train"].update(max_steps=2, eval_every=2, seed=9)
    train(from_dict(raw), base, overwrite=True, quiet=True)  # other weights in its place
    with pytest.raises(CheckpointError, match="has changed since"):
        load_model_dir(tmp_path / "lora")


def test_adapters_need_init_from(corpus):
    raw = tiny_config(corpus)
    raw["train"]["adapters"] = {"rank": 4}
    with pytest.raises(ConfigError, match=r"train\.init_from"):
        from_dict(raw)


def test_3_init_from_a_lora_model_fine_tunes_its_merged_weights(tmp_path: Path, corpus, base):
    """Issue 77, item 3: `train --init-from` a model trained with adapters refused its own
    weights ("does not fit the model in config.yaml"); it starts from them merged."""
    train(from_dict(adapter_config(corpus, base, steps=4)), tmp_path / "lora", quiet=True)
    raw = tiny_config(corpus)
    raw["train"].update(init_from=str(tmp_path / "lora"), max_steps=2, eval_every=2)
    train(from_dict(raw), tmp_path / "tuned", quiet=True)

    def losses(run: Path, kind: str) -> list[float]:
        lines = (tmp_path / run / "train_log.jsonl").read_text().splitlines()
        return [e["dev_loss"] for e in map(json.loads, lines) if e["event"] == kind]

    # It starts where the adapted model ended (its dev loss, merged: equal up to rounding),
    # not where the base did.
    start = losses(Path("tuned"), "init_from")[0]
    assert start == pytest.approx(losses(Path("lora"), "validation")[-1], rel=1e-4)
    assert start != pytest.approx(losses(base, "validation")[-1], rel=1e-4)
    stored, _, _ = read_tensors(tmp_path / "tuned" / "best.safetensors")
    assert not any(name.endswith(("lora_a", "lora_b")) for name in stored)  # a whole model
    assert len(Translator.load(tmp_path / "tuned", device="cpu").translate(["w1 w2"])) == 1
    # New adapters on adapters: refused in one line, saying what to do instead.
    with pytest.raises(ConfigError, match=r"fine-tune it without train\.adapters"):
        train(from_dict(adapter_config(corpus, tmp_path / "lora")), tmp_path / "x", quiet=True)


def test_5_init_from_with_subword_sampling_trains(tmp_path: Path, corpus, base):
    """Issue 77, item 5: sampling draws segmentations from the same SentencePiece model while
    training; a fine-tuning run may turn it on (it was refused as "a new tokenizer")."""
    raw = tiny_config(corpus)
    raw["tokenizer"]["sampling"] = {"alpha": 0.2, "nbest": 8}
    raw["train"].update(init_from=str(base), max_steps=4, eval_every=4)
    summary = train(from_dict(raw), tmp_path / "tuned", quiet=True)
    assert summary["steps"] == 4
    assert (tmp_path / "tuned" / "spm.model").read_bytes() == (base / "spm.model").read_bytes()
    raw["tokenizer"]["vocab_size"] = 41  # another tokenizer is still refused
    with pytest.raises(ConfigError, match="keeps its source's tokenizer"):
        train(from_dict(raw), tmp_path / "other", quiet=True)


def test_an_adapter_rank_past_the_layers_size_is_refused_in_one_line(tmp_path: Path, corpus, base):
    """Issue 77 (also seen): rank 4,096 on a d64 model trained adapters larger than the
    weights they adapt."""
    raw = adapter_config(corpus, base, steps=2)
    raw["train"]["adapters"]["rank"] = 8  # the 16 x 16 projections: 8 x 32 = 256 parameters
    with pytest.raises(ConfigError, match=r"rank 8: an adapter of q \(16 x 16\).*at most 7"):
        train(from_dict(raw), tmp_path / "lora", quiet=True)
    assert not (tmp_path / "lora").exists()
    raw["train"]["adapters"]["rank"] = 7
    train(from_dict(raw), tmp_path / "lora", quiet=True)
