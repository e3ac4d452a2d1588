"""The `ppjd` config section: shipped YAMLs and loud failures naming the key."""

from pathlib import Path

import pytest

from pjray.config import ConfigError, load

CONFIGS = Path(__file__).parents[2] / "configs"


def test_shipped_ppjd_configs():
    scenes = load(CONFIGS / "ppjd_scenes.yaml").ppjd
    assert (scenes.source, scenes.perturb_backend, scenes.vqa_backend) == ("scenes", "rules", "oracle")
    assert 0 < scenes.num_cpus_per_actor < 1 and scenes.num_gpus_per_actor == 0
    mmpr = load(CONFIGS / "ppjd_mmpr.yaml").ppjd
    assert (mmpr.source, mmpr.perturb_backend, mmpr.vqa_backend, mmpr.llm_engine) == ("mmpr", "llm", "vlm", "vllm")
    assert mmpr.num_gpus_per_actor > 0 and mmpr.paths and mmpr.decontam_files


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["ppjd.source=mmpr"], "ppjd.paths"),
        (["ppjd.source=jsonl", "ppjd.paths=[a.jsonl]"], "ppjd.vqa_backend"),  # the oracle needs scene facts
        (["ppjd.perturb_backend=llm"], "ppjd.llm_model"),
        (["ppjd.vqa_backend=vlm"], "ppjd.vlm_model"),
        (["ppjd.num_candidates=7"], "ppjd.num_candidates"),
        (
            [
                "ppjd.source=jsonl",
                "ppjd.paths=[a.jsonl]",
                "ppjd.vqa_backend=vlm",
                "ppjd.vlm_model=v",
                "ppjd.num_candidates=7",
            ],
            "ppjd.num_candidates",
        ),
        (["ppjd.perturb_backend=llm", "ppjd.llm_model=m", "ppjd.num_candidates=4"], "ppjd.num_candidates"),
        (["ppjd.llm_engine=cuda"], "ppjd.llm_engine"),
        (["ppjd.vqa_backend=magic"], "ppjd.vqa_backend"),
        (["ppjd.shard_size=0"], "ppjd.shard_size"),
        (["ppjd.num_cpus_per_actor=-1"], "ppjd.num_cpus_per_actor"),
        (["ppjd.paths=[x]"], "ppjd.paths"),
        (["ppjd.colour=red"], "colour"),
        (["ppjd.max_reject_fraction=0"], "ppjd.max_reject_fraction"),
        (["ppjd.max_reject_fraction=1.5"], "ppjd.max_reject_fraction"),
    ],
)
def test_bad_ppjd_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load(overrides=overrides)


def test_rules_backend_rewrites_free_text_sources():
    p = load(
        overrides=[
            "ppjd.source=jsonl",
            "ppjd.paths=[a.jsonl]",
            "ppjd.vqa_backend=vlm",
            "ppjd.vlm_model=v",
            "ppjd.num_candidates=6",
        ]
    ).ppjd
    assert (p.source, p.perturb_backend, p.num_candidates) == ("jsonl", "rules", 6)
