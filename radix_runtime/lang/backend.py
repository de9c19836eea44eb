"""Where programs run: the ``Backend`` interface and ``RuntimeEndpoint``, a client of a running
server's native routes (``/generate``, ``/get_model_info``, ...).

The client is the standard library's ``urllib`` (one connection per request), so the frontend
needs nothing beyond the runtime's own dependencies and never imports torch.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from radix_runtime.lang.ir import GenParams

# Prompt positions before the shared prefix's end whose token ids ``select`` compares, to find
# where a choice's tokens start when tokenizing prefix + choice merges across the boundary.
SELECT_BOUNDARY_WINDOW = 4


class ServerError(RuntimeError):
    """The server answered with an error (or could not be reached: ``status`` is None)."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message if status is None else f"{message} (HTTP {status})")
        self.message = message
        self.status = status
        self.code = code
        self.param = param

    @classmethod
    def from_body(cls, status: int | None, body: bytes | dict) -> ServerError:
        """From an OpenAI-shaped error body ``{"error": {"message", "code", "param"}}``."""
        data: Any = body
        if isinstance(body, bytes):
            try:
                data = json.loads(body)
            except ValueError:
                text = body.decode("utf-8", "replace").strip()
                return cls(text or "empty error response", status=status)
        err = data.get("error") if isinstance(data, dict) else None
        if not isinstance(err, dict):
            return cls(str(data), status=status)
        return cls(
            str(err.get("message", "unknown error")),
            status=status,
            code=err.get("code"),
            param=err.get("param"),
        )


@dataclass(frozen=True)
class RoleMarkers:
    """The text around each role's content, from the model's chat template.

    ``begin`` opens a conversation (e.g. the BOS text); ``default_system`` is the system turn the
    template inserts when the conversation does not start with one; ``system`` is None when the
    template has no system turn of its own."""

    begin: str
    system: tuple[str, str] | None
    user: tuple[str, str]
    assistant: tuple[str, str]
    generation_prompt: str
    default_system: str

    @classmethod
    def from_template(cls, template: str) -> RoleMarkers:
        # the tokenizer package's helpers render exactly as the server does; only jinja2 and the
        # (Rust) tokenizers library come with them
        from radix_runtime.tokenizer import chat_template as ct

        def render(messages: list[dict], add_generation_prompt: bool) -> str:
            # bos_token is left undefined (renders empty): /generate adds BOS to text prompts
            # itself when the model's tokenizer wants one
            return ct.render_chat(template, messages, add_generation_prompt)

        markers = ct.derive_role_markers(render, None)
        system = markers["system"]
        return cls(
            begin=markers["begin"],
            system=tuple(system) if system is not None else None,
            user=tuple(markers["user"]),
            assistant=tuple(markers["assistant"]),
            generation_prompt=markers["generation_prompt"],
            default_system=markers["default_system"],
        )

    def around(self, role: str) -> tuple[str, str]:
        markers = getattr(self, role)
        if markers is None:
            raise ValueError(f"this model's chat template has no {role} turn")
        return markers


@dataclass
class GenResult:
    text: str
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class SelectResult:
    index: int
    choice: str
    normalized_logprobs: list[float]  # mean logprob per token of each choice
    token_logprobs: list[list[float]]  # the logprob of each scored token of each choice
    prefix_tokens: int  # tokens of the prompt the choices follow

    @property
    def meta_info(self) -> dict[str, Any]:
        return {
            "normalized_logprobs": self.normalized_logprobs,
            "token_logprobs": self.token_logprobs,
            "prefix_tokens": self.prefix_tokens,
        }


class Backend:
    """What a program state needs from a model server."""

    def role_markers(self) -> RoleMarkers:
        raise NotImplementedError

    def generate(
        self, prompt: str, params: GenParams, on_text: Callable[[str], None] | None = None
    ) -> GenResult:
        """Continue ``prompt``; with ``on_text`` stream, calling it with each new piece."""
        raise NotImplementedError

    def generate_n(self, prompt: str, params: GenParams, n: int) -> list[GenResult]:
        """``n`` independent continuations of ``prompt`` (``gen(n=...)``)."""
        return [self.generate(prompt, params) for _ in range(n)]

    def select(self, prompt: str, choices: Sequence[str]) -> SelectResult:
        raise NotImplementedError

    def cache_prefix(self, prompt: str) -> int:
        """Compute ``prompt`` once so the radix tree holds it (a zero-token generate); returns
        its length in tokens."""
        raise NotImplementedError

    def flush_cache(self) -> dict:
        raise NotImplementedError

    def get_server_info(self) -> dict:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release what the backend holds (a launched server); a no-op for a remote one."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class RuntimeEndpoint(Backend):
    """A running ``radix-runtime serve`` at ``url``."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float | None = 600,
        cache_salt: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        # every /generate request carries it: the program's prefixes are cached in its own
        # namespace, shared only with requests of the same salt (docs/tenancy.md)
        self.cache_salt = cache_salt
        host = urllib.parse.urlsplit(self.url).hostname or ""
        # proxies from the environment must not capture a server on this machine
        handlers = [urllib.request.ProxyHandler({})] if _is_loopback(host) else []
        self._opener = urllib.request.build_opener(*handlers)
        self._markers: RoleMarkers | None = None
        self._markers_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.url!r})"

    # --- HTTP

    def _open(self, method: str, path: str, body: Any = None) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            if self.cache_salt is not None and path == "/generate":
                body = {**body, "cache_salt": self.cache_salt}
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            return self._opener.open(req, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            with exc:
                raise ServerError.from_body(exc.code, exc.read()) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerError(f"cannot reach the server at {self.url}: {reason}") from None

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One JSON request; an error status raises :class:`ServerError`."""
        with self._open(method, path, body) as resp:
            return json.loads(resp.read())

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """The JSON events of an SSE response; an error event raises :class:`ServerError`."""
        with self._open("POST", path, {**body, "stream": True}) as resp:
            for line in resp:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise ServerError.from_body(None, event)
                yield event

    # --- server routes

    def get_model_info(self) -> dict:
        return self.request("GET", "/get_model_info")

    def get_server_info(self) -> dict:
        return self.request("GET", "/get_server_info")

    def flush_cache(self) -> dict:
        return self.request("POST", "/flush_cache")

    def health(self) -> bool:
        try:
            with self._open("GET", "/health"):
                return True
        except ServerError:
            return False

    # --- Backend

    def role_markers(self) -> RoleMarkers:
        with self._markers_lock:
            if self._markers is None:
                template = self.get_model_info().get("chat_template")
                if not template:
                    # the server renders chats with its ChatML fallback then; so do we
                    from radix_runtime.tokenizer.chat_template import CHATML_TEMPLATE

                    template = CHATML_TEMPLATE
                self._markers = RoleMarkers.from_template(template)
            return self._markers

    def generate(
        self, prompt: str, params: GenParams, on_text: Callable[[str], None] | None = None
    ) -> GenResult:
        body = {
            "text": prompt,
            "sampling_params": params.to_sampling_params(),
            **params.request_options(),
        }
        if on_text is None:
            out = self.request("POST", "/generate", body)
            return GenResult(out["text"], out["meta_info"])
        # streamed events carry the cumulative text; hand on what is new
        text, meta = "", {}
        for event in self.stream("/generate", body):
            new = event["text"]
            if len(new) > len(text):
                on_text(new[len(text) :])
                text = new
            meta = event["meta_info"]
        return GenResult(text, meta)

    def generate_n(self, prompt: str, params: GenParams, n: int) -> list[GenResult]:
        """One batched ``/generate`` of ``n`` copies of the prompt (the radix tree computes the
        prompt once). A seeded gen gives copy ``i`` the seed ``seed + i`` so that the copies
        differ; those go as ``n`` requests, one seed each."""
        if params.seed is not None:
            return [
                self.generate(prompt, dataclasses.replace(params, seed=params.seed + i))
                for i in range(n)
            ]
        body = {
            "text": [prompt] * n,
            "sampling_params": params.to_sampling_params(),
            **params.request_options(),
        }
        return [
            GenResult(out["text"], out["meta_info"])
            for out in self.request("POST", "/generate", body)
        ]

    def cache_prefix(self, prompt: str) -> int:
        out = self.request(
            "POST", "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 0}}
        )
        return out["meta_info"]["prompt_tokens"]

    def select(self, prompt: str, choices: Sequence[str]) -> SelectResult:
        """Score each choice by its mean token logprob after ``prompt``, from prompt logprobs.

        The prompt is sent once (a zero-token generate: the radix tree then holds it, and its
        token count ``P`` comes back); then one batched ``/generate`` scores ``prompt`` and each
        ``prompt + choice`` with prompt logprobs from position ``P - W``. A choice's tokens are
        those after the longest run of ids it shares with the prompt's own, so a token that
        tokenization merges across the boundary (``"A: "`` + ``"yes"`` -> ``" yes"``) is scored
        with the choice. The scheduler recomputes only the last ``W`` prompt tokens per choice.
        """
        choices = list(choices)
        n_prefix = self.cache_prefix(prompt) if prompt else 0
        # the prompt itself rides along (when there is one) to show its own ids at the boundary
        texts = ([prompt] if prompt else []) + [prompt + c for c in choices]
        outs = self.request(
            "POST",
            "/generate",
            {
                "text": texts,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": max(n_prefix - SELECT_BOUNDARY_WINDOW, 0),
            },
        )
        prompt_ids = [tok for _, tok in _input_logprobs(outs.pop(0))] if prompt else []
        scores, per_token = [], []
        for out in outs:
            pairs = _input_logprobs(out)
            shared = _common_length(prompt_ids, [tok for _, tok in pairs])
            # None: position 0 of the whole prompt, which has no logprob
            logprobs = [lp for lp, _ in pairs[shared:] if lp is not None]
            per_token.append(logprobs)
            scores.append(sum(logprobs) / len(logprobs) if logprobs else float("-inf"))
        best = max(range(len(choices)), key=scores.__getitem__)
        return SelectResult(best, choices[best], scores, per_token, n_prefix)


def _input_logprobs(out: dict) -> list[list]:
    return out["meta_info"]["input_token_logprobs"]


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
