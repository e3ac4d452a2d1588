"""The config schema: defaults, YAML + overrides, and loud failures naming the key."""

import dataclasses
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pjray.config import CHECK, Check, Config, ConfigError, load, to_dict, to_yaml

REPO = Path(__file__).parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_defaults_are_the_cpu_demo():
    cfg = load()
    assert isinstance(cfg, Config)
    assert cfg.rollout.backend == "hybrid" and cfg.model.path == "" and cfg.data.source == "scenes"
    assert cfg.learner.num_gpus_per_rank == 0 and cfg.rollout.num_gpus_per_worker == 0


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_yaml_loads(path):
    cfg = load(path)
    assert to_dict(cfg)["algo"]["group_size"] == cfg.algo.group_size


def test_shipped_configs_exist():
    assert any(p.name == "demo.yaml" for p in CONFIGS)


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_demo_yaml_is_the_embedded_default():
    """configs/demo.yaml says `pjray train` with no arguments runs exactly it: every value it
    writes out is the schema's default, whatever the defaults become."""
    written = leaves(OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "demo.yaml")))
    defaults = leaves(to_dict(load()))
    assert written, "demo.yaml is empty"
    differ = {k: (v, defaults.get(k, "<no such key>")) for k, v in written.items() if defaults.get(k, object()) != v}
    assert not differ, f"demo.yaml (value, default): {differ}"
    assert load(REPO / "configs" / "demo.yaml") == load()


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("algo:\n  group_size: 6\ntrainer:\n  prompts_per_step: 4\n")
    cfg = load(f, ["algo.group_size=8", "reward.metric=kendall"])
    assert cfg.algo.group_size == 8 and cfg.trainer.prompts_per_step == 4
    assert cfg.reward.metric == "kendall"


def test_round_trip_through_yaml(tmp_path):
    cfg = load(overrides=["algo.kl_coef=0.0", "learner.lr=3e-6"])
    f = tmp_path / "round.yaml"
    f.write_text(to_yaml(cfg))
    assert load(f) == cfg


@pytest.mark.parametrize(
    "override, key",
    [
        ("algo.bogus=1", "algo.bogus"),
        ("nosuchsection.x=1", "nosuchsection"),
        ("algo.group_size=many", "algo.group_size"),
        ("reward.metric=bleu", "reward.metric"),
        ("rollout.backend=sglang", "rollout.backend"),
        ("algo.group_size=1", "algo.group_size"),
        ("learner.zero_stage=4", "learner.zero_stage"),
        ("data.num_candidates=27", "data.num_candidates"),
        ("data.num_candidates=7", "data.num_candidates"),
        ("data.source=parquet", "data.path"),
        ("data.path=/x.parquet", "data.path"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("rollout.backend=vllm", "rollout.num_gpus_per_worker"),
        ("learner.bf16=true", "learner.bf16"),
        ("learner.micro_batch_size=5", "learner.micro_batch_size 5"),
        ("trainer.resume=/no/such/dir", "trainer.resume"),
        ("algo.dual_clip=0.5", "algo.dual_clip"),
        ("learner.lr=-1", "learner.lr"),
        ("reward.function=no_colon", "reward.function"),
        ("reward.overlong_buffer=49", "reward.overlong_buffer"),  # above rollout.max_new_tokens (48)
        ("reward.overlong_penalty=-1", "reward.overlong_penalty"),
        # The hybrid default has no rollout workers and no weight sync to configure.
        ("rollout.num_workers=2", "rollout.num_workers"),
        ("rollout.num_cpus_per_worker=1", "rollout.num_cpus_per_worker"),
        ("trainer.sync_backend=shm", "trainer.sync_backend"),
        ("rollout.hybrid_gather=half", "rollout.hybrid_gather"),
        ("rollout.num_threads=-1", "rollout.num_threads"),
        ("learner.num_threads=-2", "learner.num_threads"),
        # Only vLLM compiles, and only colocated engines sleep.
        ("rollout.enforce_eager=true", "rollout.enforce_eager"),
        ("rollout.sleep_level=1", "rollout.sleep_level"),
    ],
)
def test_bad_configs_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load(overrides=[override])


def test_scene_cap_matches_the_perturber():
    from pjray.config import SCENE_MAX_CANDIDATES
    from pjray.ppjd.perturb import MAX_CANDIDATES

    assert SCENE_MAX_CANDIDATES == MAX_CANDIDATES


def test_scores_style_caps_candidates():
    with pytest.raises(ConfigError, match=r"data\.num_candidates"):
        load(overrides=["reward.style=scores", "data.num_candidates=11", "data.source=parquet", "data.path=x"])


def test_unknown_key_in_yaml_names_it(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("trainer:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"trainer\.stepz"):
        load(f)


def test_missing_file_and_malformed_override():
    with pytest.raises(ConfigError, match="no such file"):
        load("no/such/file.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        load(overrides=["algo.group_size"])


def test_scene_kinds_are_checked_and_cycle_through_the_scene_rows():
    from pjray.ppjd.sources import scene_rows

    with pytest.raises(ConfigError, match="data.scene_kinds"):
        load(overrides=["data.scene_kinds=[colour]"])
    with pytest.raises(ConfigError, match="ppjd.scene_kinds"):
        load(overrides=["ppjd.scene_kinds=[]"])
    with pytest.raises(ConfigError, match="data.scene_objects"):
        load(overrides=["data.scene_objects=[0,2]"])
    with pytest.raises(ConfigError, match="spatial questions need at least 2"):
        load(overrides=["data.scene_kinds=[spatial]", "data.scene_objects=[1,3]", "data.construction=nested"])
    cfg = load(overrides=["data.scene_kinds=[size,count]", "data.scene_objects=[3,3]"])
    rows = scene_rows(4, 0, 64, cfg.data.scene_kinds, cfg.data.scene_objects)
    assert [r.id.split("-")[2] for r in rows] == ["size", "count", "size", "count"]
    assert all(json.loads(r.scene)["objects"] == [3, 3] for r in rows)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data.counterfactual_pairs=true", "data.scene_kinds=[color,count]"], "data.counterfactual_pairs"),
        (["data.counterfactual_pairs=true", "data.source=parquet", "data.path=/x.parquet"], "data.source=scenes"),
        (["data.counterfactual_pairs=true", "algo.group_size=5", "trainer.prompts_per_step=16"], "algo.group_size=5"),
        (["trainer.export_steps=[0,10]"], "trainer.export_steps"),
        (["trainer.export_steps=[41]"], "trainer.export_steps"),
        (["eval.bench=looking", "eval.scene_kinds=[color,size]", "eval.num_items=32"], "eval.num_items=32"),
        (
            ["eval.bench=looking", "eval.scene_kinds=[size]", "eval.num_items=24", "eval.blind=[grey]"],
            "eval.bench=looking",
        ),
        (["eval.bench=looking", "eval.num_items=24"], "eval.scene_kinds"),  # the default holds every kind
    ],
)
def test_looking_options_are_checked(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("[", r"\[")):
        load(overrides=overrides)
    assert load(overrides=["data.counterfactual_pairs=true", "trainer.export_steps=[10,20]"]).data.counterfactual_pairs
    assert (
        load(overrides=["eval.bench=looking", "eval.scene_kinds=[color,size]", "eval.num_items=120"]).eval.bench
        == "looking"
    )


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["trainer.max_staleness=1"], "rollout.backend=hybrid generates on the learner ranks"),
        (["trainer.max_staleness=-1", "rollout.backend=hf"], "must be >= 0"),
        (["trainer.max_staleness=1", "rollout.backend=hf", "algo.filter_zero_std=true"], "algo.filter_zero_std"),
        (
            [
                "trainer.max_staleness=1",
                "rollout.backend=vllm",
                "rollout.colocate=true",
                "learner.num_gpus_per_rank=0.5",
                "rollout.num_gpus_per_worker=0.4",
                "rollout.device=cuda",
            ],
            "colocated engines sleep",
        ),
    ],
)
def test_async_rollouts_refuse_the_layouts_that_cannot_overlap(overrides, says):
    with pytest.raises(ConfigError, match=r"trainer\.max_staleness") as err:
        load(overrides=overrides)
    assert says in str(err.value)


def test_async_rollouts_load_on_split_layouts():
    cfg = load(overrides=["trainer.max_staleness=2", "rollout.backend=hf", "algo.rollout_is=token"])
    assert cfg.trainer.max_staleness == 2


def _checked_fields(cls: type, prefix: str) -> list[tuple[str, object, Check]]:
    """(key, default, check) of every field that `opt` gave a rule, nested sections included."""
    out = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(default := f.default_factory()):
            out += _checked_fields(type(default), f"{prefix}{f.name}.")
        elif CHECK in f.metadata:
            out.append((f"{prefix}{f.name}", f.default, f.metadata[CHECK]))
    return out


CHECKED = _checked_fields(Config, "")


def _breaking(default: object, check: Check) -> list[object]:
    """Values just outside the rule: a value no choice is, each bound itself where it is open, one
    step beyond it where it is closed."""
    if check.choices:
        return [max(check.choices) + 1 if isinstance(default, int) else "bogus"]
    step = 1 if isinstance(default, int) else 0.5
    return [
        v
        for v in (
            check.gt,
            None if check.ge is None else check.ge - step,
            check.lt,
            None if check.le is None else check.le + step,
        )
        if v is not None
    ]


def test_every_field_rule_is_checked_by_the_generic_validator():
    """Each field carrying choices or a range rejects a value just outside it, with the message
    naming the key; its default and every choice pass."""
    assert len(CHECKED) > 100
    for key, default, check in CHECKED:
        assert check.passes(default), key
        assert all(check.passes(c) for c in check.choices), key
        breaking = _breaking(default, check)
        assert breaking, key
        for bad in breaking:
            with pytest.raises(ConfigError) as err:
                load(overrides=[f"{key}={bad}"])
            assert str(err.value) == check.error(key, type(default)(bad)), (key, bad)
            assert str(err.value).startswith(f"{key}={type(default)(bad)!r}: "), (key, bad)


@pytest.mark.parametrize(
    "check, rule",
    [
        (Check(gt=0), "> 0"),
        (Check(ge=0), ">= 0"),
        (Check(gt=0, le=1), "in (0, 1]"),
        (Check(ge=0, lt=1), "in [0, 1)"),
        (Check(ge=0, le=1), "in [0, 1]"),
        (Check(ge=2, le=26, integer=True), "in 2..26"),
    ],
)
def test_rules_read_as_the_messages_say(check, rule):
    assert check.rule() == rule
    assert check.error("a.b", -1).startswith(f"a.b=-1: must be {rule}")
    assert Check(choices=("x", "y")).error("a.b", "z") == "a.b='z': expected one of x, y"


def test_rollout_correction_auto_is_resolved_once_in_the_config():
    """algo.rollout_is=auto: none for the hybrid engine (the learner's own samples), token (TIS)
    where rollout workers sample; a level asked for stays."""
    assert load().algo.rollout_is == "none"
    assert load(overrides=["rollout.backend=hf"]).algo.rollout_is == "token"
    assert load(overrides=["rollout.backend=hf", "algo.rollout_is=sequence"]).algo.rollout_is == "sequence"
    assert load(overrides=["rollout.backend=hf", "algo.rollout_is=none"]).algo.rollout_is == "none"


def test_the_config_package_imports_no_domain_code():
    """pjray.config imports the standard library, omegaconf, pjray.errors and its own modules
    only (the scene names it checks against are defined in it), so loading a config starts no
    model stack and no domain module can import it back in a cycle."""
    import ast
    import subprocess
    import sys

    allowed = {*sys.stdlib_module_names, "omegaconf", "pjray.errors", "pjray.config"}
    for path in sorted((REPO / "pjray" / "config").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        for name in imported:
            assert any(name == a or name.startswith(f"{a}.") for a in allowed), (path.name, name)
    code = "import sys, pjray.config; print(sorted(m for m in sys.modules if m.startswith('pjray') and not m.startswith('pjray.config')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['pjray', 'pjray.errors']"


@pytest.mark.parametrize(
    "override, says",
    [
        ("algo.dual_clip=-1", "algo.dual_clip=-1.0: must be > 1 (or 0 to disable)"),
        ("algo.dual_clip=1", "algo.dual_clip=1.0: must be > 1 (or 0 to disable)"),
        ("algo.rollout_is_upper=0", "algo.rollout_is_upper=0.0: must be > 0"),  # checked with or without a correction
        ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization=1.5: must be in (0, 1]"),
    ],
)
def test_field_rules_once_beside_their_field(override, says):
    with pytest.raises(ConfigError) as err:
        load(overrides=[override])
    assert str(err.value) == says
    assert load(overrides=["algo.dual_clip=0"]).algo.dual_clip == 0
