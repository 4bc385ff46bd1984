"""Engine workers as services, and many of them behind one gateway.

messages (every wire struct), worker + worker_kv (the step loop as a service: KV events, prefill
holds, decode pulls), client (the EngineClient interface), gateway + launch (the ClusterClient:
registration, routing, disaggregation, failover), registry (membership), kv_index + kv_events
(which worker holds which block), router (policies, load tracking), transfer (KV bytes between
workers), migration (request legs, retry / migrate / fail), stats, cli (`kiln worker`)."""
