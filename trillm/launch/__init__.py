"""The launcher: what `trillm serve` runs around the HTTP app. The command line (cli), serving
one app under Hypercorn with a bounded stop (serve), supervising data-parallel replicas behind
vllm-router (data_parallel) and the router's KV-event feed (router_events). It imports the HTTP
layer; nothing under trillm/http imports it."""
