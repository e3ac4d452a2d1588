"""Weight sync, learner -> rollout engines: the learner's side of every transport (`sender`), the
broadcast group (`collective`), shared-memory buffers (`shared`), CUDA IPC handles (`ipc`), the
bucket plan they all use (`buckets`) and the driver's side, one class per transport
(`transports`, chosen once by `auto_transport`).

`sender.WeightSender` is mixed into `pjray.rl.learner.LearnerRank`, so every transport is a method of
the learner actor the driver calls, while the learner file stays about learning. Under ZeRO-3
the learner gathers parameters bucket by bucket (`WeightSender._full_buckets`), so every learner
rank must take part in a sync, even though only rank 0 (or, for IPC, each rank for its own
engine) sends. Transports (`trainer.sync_backend`):

* Object store (`export_weights` + `RolloutEngine.load_weights`): works for every layout and is
  the CPU path. Rank 0 puts each packed bucket in the Ray object store once.
* Broadcast (`nccl`, or `gloo`): a process group of learner rank 0 plus every vLLM rank (world =
  1 + engines x tensor_parallel_size), built on its own TCP store so it never touches
  DeepSpeed's default group. Rank 0 packs each bucket (`buckets.pack`) and broadcasts the flat
  buffer; each vLLM rank receives it into an empty buffer and loads it. One collective per
  bucket, one RPC per engine per sync. NCCL for engines on their own GPUs (NCCL refuses two
  ranks of one communicator on the same GPU); gloo is the same code on CPU tensors.
* Shared memory (`shm`, engines on learner rank 0's node; what `auto` picks for the HF engine
  there): rank 0 writes each bucket in place into a flat buffer in shared memory
  (`SharedBuckets`: a file in /dev/shm mapped by both sides, created once and reused at every
  sync), and each engine maps the same file once (`SharedBucketReader`) and copies from it into
  its parameters. One copy in and one copy out; nothing is serialised or sent over a socket.
* IPC (`ipc`, colocated): learner rank i streams its buckets to engine i on the same GPU
  through two reused CUDA buffers, shared once per sync as CUDA IPC handles (`ipc`): it packs
  bucket k+1 while the engine loads bucket k, and packs a buffer again only once the engine has
  loaded it. Costs two buckets of GPU memory, freed (with the allocator's cached blocks) before
  the engine wakes its KV cache.

With LoRA, `adapter` (model.lora.sync=adapter, rollout workers of their own) sends the adapter
alone instead of the merged weights: rank 0 puts PEFT's state dict and config in the object store
once (`WeightSender.export_adapter`, the message `adapter.AdapterUpdate`), and every engine
applies it over the base weights it loaded at start-up (vLLM as a LoRA adapter, the HF engine
through PEFT): for a 7B judge at rank 8, tens of MB instead of ~15 GB.

The receiving side of the broadcast and IPC paths is `pjray.rollout.vllm_engine.WeightSyncExtension`.
"""
