"""Judge evaluation: MLLM-as-a-Judge protocols, the Mode a / Mode b diagnosis, MM-JudgeBias.

`metrics` holds the pure metric functions; `judge_bench`, `bias` and `mm_judgebias` turn
benchmark rows into judge prompts and judge outputs into metric records; `runner` judges through
Ray rollout workers with a per-item cache (`pjray eval`); `report` writes JSON, markdown, plots.
"""
