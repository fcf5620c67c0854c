"""Wire messages, one module per destination: reading one module tells a process's whole input.

- `to_tokenizer`: what the tokenizer process receives, from SDK clients (ROUTER) and from the
  engine (its PULL socket: detokenizer output, launcher control).
- `to_scheduler`: what the scheduler process receives (tokenized requests, aborts, queries, drain).
- `to_detokenizer`: what the detokenizer process receives from the scheduler.
- `to_client`: what an SDK client receives from the tokenizer process.
- `to_launcher`: what the launcher receives (READY handshakes, start failures, shutdown requests).
- `to_ranks`: what rank 0 broadcasts to every tensor-parallel scheduler rank, once per iteration.
"""
