"""Engine workers as services, and many of them behind one gateway.

messages (every wire struct), worker + worker_kv (the step loop as a service: KV events, prefill
holds, decode pulls), engine_client (the EngineClient interface), cluster_client + launch (the
ClusterClient, a façade over transport (the gateway's sockets), placement (routing, the
prefill -> decode handoff) and supervision (registration, health, restarts, failover)),
registry (membership), kv_index + kv_events (which worker holds which block), router
(policies, load tracking), transfer (KV bytes between workers), migration (request legs,
retry / migrate / fail), stats, cli (`kiln worker`)."""
