"""The rollout side: engines that sample judge responses (`engine`: the interface and what every
engine keeps; `hf_engine`, `vllm_engine`) and the rollout worker actor around one (`worker`)."""
