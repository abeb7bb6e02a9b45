import pytest

from spel_mlx.config import PRESETS, ConfigError, ModelConfig, parse_config_string, resolve_config
from spel_mlx.layout import draft_specs, target_specs, tensor_specs


@pytest.mark.parametrize("preset,target,draft", [("21m", 21_352_044, 7_084_452),
                                                 ("218m", 218_436_992, 54_543_456)])
def test_parameter_counts(preset, target, draft):
    cfg = PRESETS[preset]
    assert cfg.target_params() == target
    assert cfg.draft_params() == draft
    assert sum(t.numel for t in target_specs(cfg)) == target
    assert sum(t.numel for t in draft_specs(cfg)) == draft


def test_gdn_mixer_count_and_layer_types():
    cfg = PRESETS["21m"]
    assert cfg.mixer_params("gdn") == 590_988
    assert cfg.attention_layers == [3, 7, 11]
    assert len(PRESETS["218m"].gdn_layers) == 12 and len(PRESETS["218m"].attention_layers) == 4


def test_names_unique():
    names = [t.name for t in tensor_specs(PRESETS["21m"])]
    assert len(names) == len(set(names))


def test_config_string_and_env():
    cfg = resolve_config("21m", "d_model=1024,n_layers=16,draft_map=0:3:6", environ={})
    assert cfg.d_model == 1024 and cfg.n_layers == 16 and cfg.draft_map == (0, 3, 6)
    cfg = resolve_config("21m", None, environ={"SPEL_D_MODEL": "256", "SPEL_DRAFT_MAP": "0,3"})
    assert cfg.d_model == 256 and cfg.draft_map == (0, 3)
    # --config wins over env
    cfg = resolve_config("21m", "d_model=128", environ={"SPEL_D_MODEL": "256"})
    assert cfg.d_model == 128


@pytest.mark.parametrize("s,msg", [
    ("bogus=1", "unknown config key"),
    ("d_model=abc", "not a valid number"),
    ("draft_map=0:3:99", "out of range"),
    ("draft_map=0:1:2:3:4:5:6:7:8", "at most 8"),
    ("head_dim=63", "must be even"),
    ("n_heads=0", "positive"),
    ("d_model", "expected key=value"),
    ("spec_k=17", "1..16"),
])
def test_config_errors(s, msg):
    with pytest.raises(ConfigError, match=msg):
        resolve_config("21m", s, environ={})


def test_checkpoint_wins_and_contradiction_is_error():
    ck = ModelConfig(d_model=128, n_layers=4, n_heads=2, head_dim=64, d_ff=256, draft_map=(0, 3))
    assert resolve_config("21m", None, checkpoint=ck, environ={}) == ck
    assert resolve_config("21m", "d_model=128,spec_k=8", checkpoint=ck, environ={}).spec_k == 8
    with pytest.raises(ConfigError, match="contradicts"):
        resolve_config("21m", "d_model=384", checkpoint=ck, environ={})


def test_parse_empty():
    assert parse_config_string("") == {}
    with pytest.raises(ConfigError, match="unknown preset"):
        resolve_config("7b", None, environ={})
