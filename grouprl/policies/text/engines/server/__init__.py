"""A vLLM engine in its own process (`grouprl vllm-serve`) and the trainer's client of it
(`rollout.engine: vllm_server`): app.py (HTTP API), serve.py (the command), worker.py (code run in
each vLLM worker), channel.py (the weight-update process group), client.py (the engine the policy
uses). Nothing here imports vllm at module level except through serve / vllm_setup."""
