"""Locust users that hold multi-turn chats over a shared system prompt (``loadtests.multiturn``).

Each user is a closed loop of conversations: ``--turns`` streamed
``POST /v1/chat/completions`` requests, each carrying the system prompt, the earlier
turns with the answers the service streamed back, and a new user message. Greedy
(temperature 0), stopping at EOS or ``--max-tokens``. Every turn reports its time to
first token (``TTFT``) and end-to-end time (``E2E``) through ``events.request`` (Locust
times only a stream's headers) and, with ``--records``, appends one JSON line (start,
end, TTFT, turn, prompt and completion tokens, status) for the runner
(``loadtests.prefix_cache``). A failed turn ends its conversation.

    locust -f loadtests/chat_locustfile.py --headless --host http://127.0.0.1:8000 \\
        --shape const:2:120 --records /tmp/chat-records.jsonl
"""

from __future__ import annotations

import itertools
import json
import time

from locust import HttpUser, events, task

from loadtests.locust_shape import SpecShape  # noqa: F401  (Locust runs the shapes it finds here)
from loadtests.multiturn import SYSTEM_PROMPT, TURNS, turn_messages, user_turns

PATH = "/v1/chat/completions"


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--shape", default="const:2:60", help="a loadtests.shapes spec")
    parser.add_argument("--model", default="", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--max-tokens", type=int, default=48, help="per answer")
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--records", default="", help="append one JSON line per turn here")


_conversations = itertools.count()
_records = None


@events.test_start.add_listener
def _start(environment, **_) -> None:
    global _records
    if environment.parsed_options.records:
        _records = open(environment.parsed_options.records, "a", buffering=1)  # noqa: SIM115 - closed at test_stop


@events.test_stop.add_listener
def _stop(environment, **_) -> None:
    global _records
    if _records is not None:
        _records.close()
        _records = None


class ChatUser(HttpUser):
    wait_time = staticmethod(lambda: 0.0)

    def on_start(self) -> None:
        self.model = self.environment.parsed_options.model
        if not self.model:
            self.model = self.client.get("/v1/models", name="/v1/models").json()["data"][0]["id"]

    @task
    def conversation(self) -> None:
        opts = self.environment.parsed_options
        conv = next(_conversations)
        history: list[tuple[str, str]] = []
        for turn, user in enumerate(user_turns(conv, opts.turns)):
            body = {"model": self.model, "messages": turn_messages(SYSTEM_PROMPT, history, user),
                    "max_tokens": opts.max_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            answer = self._turn(body, conv, turn)
            if answer is None:
                return
            history.append((user, answer))

    def _turn(self, body: dict, conv: int, turn: int) -> str | None:
        """One streamed turn -> the answer's text (None: it failed)."""
        t0 = time.time()
        ttft, parts, usage, err, status = None, [], {}, None, 0
        with self.client.post(PATH, json=body, name=f"{PATH} [headers]", stream=True, catch_response=True) as r:
            status = r.status_code
            if status != 200:
                err = RuntimeError(f"HTTP {status}")
            else:
                try:
                    for line in r.iter_lines():
                        if not line.startswith(b"data: ") or line == b"data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            err = RuntimeError(ev["error"].get("message", "stream error"))
                            break
                        text = ev["choices"][0].get("delta", {}).get("content") if ev.get("choices") else None
                        if text:
                            ttft = time.time() - t0 if ttft is None else ttft
                            parts.append(text)
                        usage = ev.get("usage") or usage
                except Exception as e:  # noqa: BLE001 - a broken stream is a failed turn
                    err = e
            if err is None:
                r.success()
            else:
                r.failure(str(err))
        t1 = time.time()
        if ttft is not None:
            events.request.fire(request_type="STREAM", name="TTFT", response_time=ttft * 1e3, response_length=0,
                                exception=None, context={})
        events.request.fire(request_type="STREAM", name="E2E", response_time=(t1 - t0) * 1e3,
                            response_length=usage.get("completion_tokens", 0), exception=err, context={})
        if _records is not None:
            _records.write(json.dumps({"t0": t0, "t1": t1, "ttft": ttft, "conversation": conv, "turn": turn,
                                       "prompt_tokens": usage.get("prompt_tokens"),
                                       "tokens": usage.get("completion_tokens", 0), "ok": err is None,
                                       "status": status}) + "\n")
        return "".join(parts) if err is None else None
