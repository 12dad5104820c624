"""What ``lmcache bench serve`` sends: the requests of a workload, their answer lengths and their
arrival times, all drawn from one seed (so two runs with the same flags send the same prompts at the
same offsets).

A workload is a list of :class:`PlannedRequest` in send order. Prompt text is made of words drawn
from a fixed built-in list, no tokenizer needed: one word is about one token for the tokenizers of
today's models, so ``--doc-tokens 2000`` makes a document of 2000 words. Each purpose (prompt text,
answer lengths, arrival times) has a random stream of its own, so that changing ``--rate`` does not
change the prompts.

- ``chat``: ``users`` conversations of ``turns`` turns, interleaved (turn 0 of every user, then
  turn 1, ...); a turn's prompt is the user's whole history (earlier prompts and the answers the
  server streamed back, known only at run time) plus a new message: see :func:`chat_prompt`.
- ``docs``: ``docs`` long documents, each asked ``questions`` short questions (question round
  ``q`` of every document, then round ``q + 1``): the reuse of a long shared prefix.
- ``distinct``: prompts with nothing in common: what a cache costs when nothing hits.
- a JSONL file (``--prompts``): its prompts as they are; lines of one ``user`` go one after another.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

import msgspec

# 250 common English words; each is one token in the vocabularies of Llama, Qwen, Mistral and
# GPT tokenizers (a leading space included), so a prompt's word count stands in for its token count.
_WORD_LIST = """
the of and to in is for on with as by at from that this it be are was were not or but an all
can has have had will would there their they them we you your our one two three four five six
seven eight ten first last new old good great small large long short high low more most many
some other such only also very well just even still back down over under after before between
through during about into out up time year day week month people world life work part place case
point group number water city state house home school book story name hand head eye face side
way line word end fact idea area money night light power room game team field music market plan
road river stone tree wood bird fish horse dog cat song paper table door window street garden
train ship car plane letter report model system data value price cost rate level order
form color sound voice heart mind body blood fire wind rain snow sun moon star sea land hill
north south east west red blue green black white gold silver iron glass clear open close begin
keep hold turn move stand sit walk run play read write speak hear see look find give take make
build show tell ask call help need want like love live learn teach change follow lead carry
bring send pay buy sell grow fall rise win lose meet leave reach pass
"""
WORDS = tuple(_WORD_LIST.split())

QUESTION_WORDS = 12  # a docs question: short beside its document
DOC_HEADER, QUESTION_HEADER, ANSWER_HEADER = "Document:\n", "\n\nQuestion: ", "\nAnswer:"
USER_HEADER, ASSISTANT_HEADER = "User: ", "\nAssistant:"


class Workload(str, Enum):
    chat = "chat"
    docs = "docs"
    distinct = "distinct"


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a run, in send order (``index``).

    ``text`` is the whole prompt, except for a chat turn, whose prompt is built at send time from
    the user's history and ``text`` (its new message). ``after`` is the index of the request that
    must have finished before this one is sent (the same user's previous turn), or None.
    ``disconnect``: the client closes the stream after the first token text (``disconnects``)."""

    index: int
    user: int | str
    turn: int
    text: str
    max_tokens: int
    after: int | None = None
    chat: bool = False
    disconnect: bool = False

    @property
    def words(self) -> int:
        """Words of ``text`` (for a chat turn, of its new message only)."""
        return len(self.text.split())


@dataclass(frozen=True)
class LengthSpread:
    """Answer lengths, uniform in ``mean * (1 - spread)`` to ``mean * (1 + spread)`` tokens (at
    least 1): equal lengths would lock in-flight requests into waves that start and end together,
    and swing the percentiles from one run to the next."""

    mean: int
    spread: float

    def bounds(self) -> tuple[int, int]:
        low = max(1, round(self.mean * (1 - self.spread)))
        return low, max(low, round(self.mean * (1 + self.spread)))

    def draw(self, rng: random.Random) -> int:
        return rng.randint(*self.bounds())


def stream(seed: int, purpose: str) -> random.Random:
    """The random stream of one purpose ("prompts", "lengths", "arrivals") of a run's seed (a str
    seed is hashed the same way on every run and machine, whatever PYTHONHASHSEED is)."""
    return random.Random(f"lmcache-bench-serve:{seed}:{purpose}")


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choices(WORDS, k=count))


def chat_plan(users: int, turns: int, message_words: int, lengths: LengthSpread,
              seed: int) -> list[PlannedRequest]:
    """``users`` x ``turns`` chat turns, interleaved; each turn after the first follows its user's
    previous one."""
    text_rng, length_rng = stream(seed, "prompts"), stream(seed, "lengths")
    plan: list[PlannedRequest] = []
    last_of: dict[int, int] = {}
    for turn in range(turns):
        for user in range(users):
            plan.append(PlannedRequest(index=len(plan), user=user, turn=turn,
                                       text=words(text_rng, message_words),
                                       max_tokens=lengths.draw(length_rng),
                                       after=last_of.get(user), chat=True))
            last_of[user] = len(plan) - 1
    return plan


def docs_plan(docs: int, doc_words: int, questions: int, lengths: LengthSpread,
              seed: int) -> list[PlannedRequest]:
    """``docs`` documents asked ``questions`` questions each, round by round (every document once,
    then every document again): a document's questions share its whole text as a prefix."""
    text_rng, length_rng = stream(seed, "prompts"), stream(seed, "lengths")
    texts = [DOC_HEADER + words(text_rng, doc_words) for _ in range(docs)]
    plan: list[PlannedRequest] = []
    for question in range(questions):
        for doc, text in enumerate(texts):
            prompt = text + QUESTION_HEADER + words(text_rng, QUESTION_WORDS) + ANSWER_HEADER
            plan.append(PlannedRequest(index=len(plan), user=doc, turn=question, text=prompt,
                                       max_tokens=lengths.draw(length_rng)))
    return plan


def distinct_plan(requests: int, prompt_words: int, lengths: LengthSpread,
                  seed: int) -> list[PlannedRequest]:
    """``requests`` prompts of random words, each its own user: no two share a prefix (two
    leading words in common are already unlikely, and a cache reuses whole blocks of 16 tokens)."""
    text_rng, length_rng = stream(seed, "prompts"), stream(seed, "lengths")
    return [PlannedRequest(index=i, user=i, turn=0, text=words(text_rng, prompt_words),
                           max_tokens=lengths.draw(length_rng)) for i in range(requests)]


def chat_prompt(history: str, message: str) -> str:
    """A chat turn's prompt: the user's history (every earlier prompt and streamed answer, as the
    last prompt followed by its answer) and the new message. Each turn's prompt starts with the
    previous prompt and answer exactly, so a prefix cache can reuse all of it."""
    return history + ("\n" if history else "") + USER_HEADER + message + ASSISTANT_HEADER


# ---------------------------------------------------------------------- a prompts file


class PromptLine(msgspec.Struct, forbid_unknown_fields=True):
    """One line of a ``--prompts`` file."""

    prompt: str
    user: int | str | None = None
    turn: int | None = None
    max_tokens: int | None = None


class PromptsFileError(ValueError):
    """A ``--prompts`` file that cannot be used; the message names the file and line."""


def file_plan(path: Path, lengths: LengthSpread, seed: int) -> list[PlannedRequest]:
    """The requests of a JSONL file, in its order; a line without ``max_tokens`` gets a length
    drawn as the generated workloads' are, one without ``user`` is a user of its own, and one
    without ``turn`` is its user's next turn. Raises :class:`PromptsFileError`."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptsFileError(f"--prompts {path}: cannot read it ({exc})") from None
    decoder = msgspec.json.Decoder(PromptLine)
    length_rng = stream(seed, "lengths")
    plan: list[PlannedRequest] = []
    last_of: dict[int | str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"--prompts {path} line {number}"
        try:
            entry = decoder.decode(line)
        except msgspec.ValidationError as exc:
            raise PromptsFileError(f"{where}: {exc}") from None
        except msgspec.DecodeError:
            raise PromptsFileError(f"{where}: not a JSON object") from None
        if not entry.prompt.strip():
            raise PromptsFileError(f"{where}: the prompt is empty")
        if entry.max_tokens is not None and entry.max_tokens < 1:
            raise PromptsFileError(f"{where}: max_tokens must be at least 1")
        if entry.turn is not None and entry.turn < 0:
            raise PromptsFileError(f"{where}: turn must not be negative")
        user: int | str = entry.user if entry.user is not None else f"line {number}"
        after = last_of.get(user)
        turn = entry.turn if entry.turn is not None else (
            0 if after is None else plan[after].turn + 1)
        max_tokens = entry.max_tokens if entry.max_tokens is not None else lengths.draw(length_rng)
        plan.append(PlannedRequest(index=len(plan), user=user, turn=turn, text=entry.prompt,
                                   max_tokens=max_tokens, after=after))
        last_of[user] = len(plan) - 1
    if not plan:
        raise PromptsFileError(f"--prompts {path}: no prompts in it")
    return plan


def disconnects(plan: list[PlannedRequest], fraction: float, seed: int) -> list[PlannedRequest]:
    """``plan`` with about ``fraction`` of its requests, drawn from the seed alone, marked to be
    closed by the client after their first token text: users who leave mid-answer, which the
    server must abort and clean up after (each request drawn on its own, so the same seed marks
    the same requests whatever the other flags)."""
    rng = stream(seed, "disconnects")
    return [replace(request, disconnect=rng.random() < fraction) for request in plan]


# ---------------------------------------------------------------------- arrivals


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of ``count`` requests arrives: a Poisson process of
    ``rate`` requests/s (exponential gaps), the first at 0, drawn from the seed alone."""
    rng = stream(seed, "arrivals")
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times
