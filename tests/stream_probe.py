"""`python tests/stream_probe.py URL MODEL REPORT`: against a running `ogrpo serve` (the job's key in the
environment), each request of a few asked twice with the same seed: as TRL's client asks it (one answer at the
end) and streamed (ogrpo.serve.prefix_stream); writes REPORT (JSON): per request, whether the two answers are the
same, the prefix lengths the stream handed over, and the completion's length."""

import json
import sys

import requests
from trl.generation.vllm_client import VLLMClient

from ogrpo.serve import auth, prefix_stream

url, model, report = sys.argv[1:4]
client = object.__new__(VLLMClient)  # TRL's own generate, without its constructor's server checks
client.session = requests.Session()
client.session.headers["Authorization"] = f"{auth.SCHEME} {auth.from_env()}"
client.base_url, client.model = url.rstrip("/"), model
cases = []
for seed, max_tokens in ((11, 24), (12, 40), (13, 7)):
    kw = dict(prompts=[[3, 4, 5, 6, 7, 8]], n=1, temperature=1.0, max_tokens=max_tokens, logprobs=0,
              generation_kwargs={"seed": seed})
    whole = VLLMClient.generate(client, **kw)
    seen = []
    streamed = prefix_stream.generate(client, lambda ids: seen.append(list(ids)), interval=4, **kw)
    ids = whole["completion_ids"][0]
    cases.append({"same": whole == streamed, "prefixes": [len(s) for s in seen], "length": len(ids),
                  "prefixes_of_it": all(s == ids[:len(s)] for s in seen)})
with open(report, "w") as f:
    json.dump(cases, f)
