"""Locust users for TreeSpark Serve: OpenAI completions with the held-out prompts.

Each user is a closed loop (no think time): concurrency = users. Requests stream by
default; Locust times only the response headers of a stream, so each request also
reports its time to first token (``TTFT``) and end-to-end latency (``E2E``) through
``events.request`` and, with ``--records``, appends one JSON line per request
(start, end, TTFT, completion tokens, status, the prompt's index in the split, the
request's seed and the text answered) for the experiment runner.

The load shape comes from ``--shape`` (see ``loadtests.shapes``). Run it on its own
(``import locust`` must precede ``requests``/``ray`` in a process, for gevent):

    locust -f loadtests/locustfile.py --headless --host http://127.0.0.1:8000 \\
        --shape ramp:1,2,4,8,16:30 --records /tmp/records.jsonl
"""

from __future__ import annotations

import itertools
import json
import time

from locust import HttpUser, events, task

from loadtests.locust_shape import SpecShape  # noqa: F401  (Locust runs the shapes it finds here)
from treespark.models.prompts import load_prompts


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--shape", default="const:1:30", help="a loadtests.shapes spec")
    parser.add_argument("--model", default="", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-stream", action="store_true", help="plain JSON responses")
    parser.add_argument("--eos", action="store_true", help="stop at EOS (default: ignore_eos, fixed lengths)")
    parser.add_argument("--records", default="", help="append one JSON line per request here")
    parser.add_argument("--prompt-split", default="heldout", choices=["heldout", "train"])
    parser.add_argument("--chat", action="store_true", help="POST /v1/chat/completions (chat template applied)")


_PROMPTS: list[str] = []
_counter = itertools.count()
_records = None


@events.test_start.add_listener
def _start(environment, **_) -> None:
    global _records
    opts = environment.parsed_options
    _PROMPTS[:] = [p.text for p in load_prompts(opts.prompt_split)]
    if opts.records:
        _records = open(opts.records, "a", buffering=1)  # noqa: SIM115 - closed at test_stop


@events.test_stop.add_listener
def _stop(environment, **_) -> None:
    global _records
    if _records is not None:
        _records.close()
        _records = None


def _record(**kw) -> None:
    if _records is not None:
        _records.write(json.dumps(kw) + "\n")


class CompletionUser(HttpUser):
    wait_time = staticmethod(lambda: 0.0)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.model = opts.model
        if not self.model:
            r = self.client.get("/v1/models", name="/v1/models")
            self.model = r.json()["data"][0]["id"]

    def _body(self) -> tuple[dict, int]:
        """The request's body (its seed: the request's number in this process), and its
        prompt's index in the split."""
        opts = self.environment.parsed_options
        i = next(_counter)
        index = i % len(_PROMPTS) if _PROMPTS else -1
        prompt = _PROMPTS[index] if _PROMPTS else "Hello"
        body = {"model": self.model, "max_tokens": opts.max_tokens,
                "temperature": opts.temperature, "seed": i, "ignore_eos": not opts.eos}
        if opts.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if not opts.no_stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body, index

    def _fire(self, name: str, seconds: float, tokens: int, exc=None) -> None:
        events.request.fire(request_type="STREAM", name=name, response_time=seconds * 1e3,
                            response_length=tokens, exception=exc, context={})

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.environment.parsed_options.chat else "/v1/completions"

    @task
    def complete(self) -> None:
        body, index = self._body()
        t0 = time.time()
        if body.get("stream"):
            self._stream(body, t0, index)
            return
        with self.client.post(self.path, json=body, name=self.path,
                              catch_response=True) as r:
            t1 = time.time()
            ok = r.status_code == 200
            tokens, text = 0, ""
            if ok:
                out = r.json()
                tokens = out.get("usage", {}).get("completion_tokens", 0)
                choice = out["choices"][0]
                text = choice.get("text") or choice.get("message", {}).get("content") or ""
            else:
                r.failure(f"HTTP {r.status_code}")
            _record(t0=t0, t1=t1, ttft=None, tokens=tokens, ok=ok, status=r.status_code, prompt=index,
                    seed=body["seed"], text=text)

    def _stream(self, body: dict, t0: float, index: int) -> None:
        ttft, tokens, err = None, 0, None
        pieces: list[str] = []
        with self.client.post(self.path, json=body, name=f"{self.path} [headers]",
                              stream=True, catch_response=True) as r:
            status = r.status_code
            if status != 200:
                err = RuntimeError(f"HTTP {status}")
                r.failure(str(err))
            else:
                try:
                    for line in r.iter_lines():
                        if not line.startswith(b"data: "):
                            continue
                        data = line[6:]
                        if data == b"[DONE]":
                            break
                        ev = json.loads(data)
                        if "error" in ev:
                            err = RuntimeError(ev["error"].get("message", "stream error"))
                            break
                        choice = ev["choices"][0] if ev.get("choices") else {}
                        piece = choice.get("text") or choice.get("delta", {}).get("content")
                        if piece:
                            pieces.append(piece)
                            if ttft is None:
                                ttft = time.time() - t0
                        if ev.get("usage"):
                            tokens = int(ev["usage"]["completion_tokens"])
                except Exception as e:  # noqa: BLE001 - a broken stream is a failed request
                    err = e
                if err is None:
                    r.success()
                else:
                    r.failure(str(err))
        t1 = time.time()
        if ttft is not None:
            self._fire("TTFT", ttft, 0)
        self._fire("E2E", t1 - t0, tokens, err)
        _record(t0=t0, t1=t1, ttft=ttft, tokens=tokens, ok=err is None, status=status, prompt=index,
                seed=body["seed"], text="".join(pieces))
