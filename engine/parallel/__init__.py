"""Device groups (EnergonAI's hierarchy controller): one engine drives T x P worker
processes that hold a model split by tensor parallelism (T ranks per stage) and pipeline
parallelism (P stages). plan.py is the pure policy, shard.py which slice of each weight a
rank holds, layers.py the modules that talk to the other ranks, worker.py a rank's
process, group.py starting and stopping them, parallel_runner.py the controller's side,
peer.py the memory pool's peer tier (layers held in other ranks' spare memory)."""
