from pathlib import Path

import pytest
import yaml

from attnmt.config import Config, apply_override, from_dict, load_config, to_yaml
from attnmt.errors import ConfigError

MINIMAL = {"data": {"train": {"src": "a", "tgt": "b"}, "dev": {"src": "c", "tgt": "d"}}}


def with_override(*assignments: str) -> dict:
    raw = yaml.safe_load(yaml.safe_dump(MINIMAL))
    for a in assignments:
        apply_override(raw, a)
    return raw


def test_defaults_filled_in():
    cfg = from_dict(MINIMAL)
    assert cfg.model.arch == "transformer"
    assert cfg.train.teacher_forcing.schedule == "constant"
    assert cfg.data.test is None


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.lrr=0.1", "unknown key 'train.lrr' (value 0.1); did you mean 'lr'? allowed keys"),
        (
            "train.batch_token=9",
            "unknown key 'train.batch_token' (value 9); did you mean "
            "'batch_tokens'? allowed keys here: max_steps",
        ),
        ("train.lr=fast", "'train.lr' = 'fast': Input should be a valid number"),
        ("train.lr=-1", "'train.lr' = -1: Input should be greater than 0"),
        ("model.arch=lstm", "'model.arch' = 'lstm': Input should be 'rnn' or 'transformer'"),
        ("train.device=tpu", "'train.device' = 'tpu': Input should be 'auto', 'cpu' or 'cuda'"),
        ("train.teacher_forcing.start=1.5", "'train.teacher_forcing.start' = 1.5"),
        ("train.teacher_forcing.schedule=cosine", "'constant', 'linear', 'exponential'"),
        ("bogus.key=1", "unknown key 'bogus'"),
        ("model.heads=3", "model.hidden_size = 256 must be divisible by model.heads = 3"),
        ("data.max_len=0", "'data.max_len' = 0: Input should be greater than or equal to 1"),
        ("decode.precision=int4", "'decode.precision' = 'int4': Input should be 'fp32', 'bf16'"),
        ("train.precision=int8", "'train.precision' = 'int8': Input should be 'auto', 'fp32'"),
    ],
)
def test_bad_values_name_key_value_and_allowed(override, expected):
    with pytest.raises(ConfigError) as e:
        from_dict(with_override(override))
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_required_key(tmp_path):
    # A model directory's config may name no data (an import); a training config must.
    assert from_dict({"data": {"train": {"src": "a", "tgt": "b"}}}).data.dev_sets == []
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  train: {src: a, tgt: b}\n")
    with pytest.raises(ConfigError, match=r"data\.dev is missing"):
        load_config(config)


def test_override_parses_yaml_values():
    cfg = from_dict(
        with_override(
            "train.lr=1e-3",
            "model.arch=rnn",
            "train.teacher_forcing={schedule: linear, start: 1.0, end: 0.5, steps: 10}",
            "tokenizer.joint=false",
        )
    )
    assert cfg.train.lr == 1e-3
    assert cfg.model.arch == "rnn"
    assert cfg.train.teacher_forcing.end == 0.5
    assert cfg.tokenizer.joint is False


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_override({}, "train.lr")
    with pytest.raises(ConfigError, match=r"'train\.lr' is a value, not a section"):
        apply_override({"train": {"lr": 1}}, "train.lr.x=1")


def test_load_config_resolves_paths_and_round_trips(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    cfg = load_config(path, ["train.seed=7"])
    assert cfg.data.train.src == tmp_path / "a"
    assert cfg.train.seed == 7
    again = Config.model_validate(yaml.safe_load(to_yaml(cfg)))
    assert again == cfg


def test_load_config_file_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  train: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listy)


@pytest.mark.parametrize(
    ("train", "expected"),
    [
        (
            [{"src": "a", "tgt": "b"}, {"src": "a", "tgt": "b", "colour": "red"}],
            "config: unknown key 'data.train[1].colour' (value 'red'); allowed keys here: src,",
        ),
        ({"src": "a", "tgt": "b", "colour": 1}, "config: unknown key 'data.train.colour'"),
        ([{"src": "a"}], "config: 'data.train[0]' = {'src': 'a'}: give src and tgt"),
        ([{"src": "a", "tgt": "b", "weight": -1}], "config: 'data.train[0].weight' = -1:"),
    ],
)
def test_errors_in_a_list_of_corpora_name_the_entry(train, expected):
    raw = {"data": {"train": train, "dev": {"src": "a", "tgt": "b"}}}
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    assert str(e.value).startswith(expected), str(e.value)
    assert "function-after" not in str(e.value) and "list[" not in str(e.value)


def test_every_shipped_config_is_valid():
    shipped = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert len(shipped) >= 10
    for path in shipped:
        cfg = load_config(path)
        assert cfg.model.arch in ("rnn", "transformer"), path
