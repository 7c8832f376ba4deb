"""What runs on the device: the compiled step and decode loop (`step`), sampling
(`sampling`), the verdict on speculative proposals (`verification`, with its
acceptance rule in `acceptance`) and the draft model's proposals (`draft`). The host's
orchestration around them (the engine, the stepping loop, requests and outputs) is in
`paxkv.engine`."""
