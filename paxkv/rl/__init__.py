"""paxkv in RL frameworks: the rollout engine of Tunix (`paxkv.rl.tunix_rollout`, the
`tunix` extra), and the mapping of a trainer's model onto paxkv's
(`paxkv.rl.tunix_models`, which needs no Tunix)."""
