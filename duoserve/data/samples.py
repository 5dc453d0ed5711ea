"""Built-in task samples, written by the project: no third-party text.

Two generators in the schemas of the real hub datasets, so every stage runs on them unchanged:

- ``squad_rows``: SQuAD-style reading comprehension (id, title, context, question, answers with
  ``text`` and ``answer_start`` lists; each answer is a span of the context).
- ``orca_math_rows``: Orca-Math-style word problems (question, answer) whose arithmetic is right
  and whose answer ends with ``The answer is N.``

Both are seeded and deterministic: the same ``(n, seed)`` gives the same rows on every machine.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "tr", "st", "kl"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "", "n", "r", "s", "l", "th", "m"]

_PLACE_KINDS = ["village", "harbour town", "mountain town", "river city", "island", "valley"]
_TRADES = ["weaving", "fishing", "glassmaking", "clockmaking", "salt mining", "shipbuilding", "tea growing", "pottery"]
_BUILDINGS = ["library", "bridge", "lighthouse", "market hall", "observatory", "school", "mill", "tower"]
_ROLES = ["engineer", "teacher", "painter", "sailor", "merchant", "doctor", "architect", "baker"]
_ITEMS = ["apples", "pencils", "marbles", "stamps", "books", "cookies", "shells", "stickers", "coins", "cards"]
_CONTAINERS = ["boxes", "bags", "crates", "baskets", "jars", "packs"]


def _word(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)]
    return ("".join(parts) + rng.choice(_CODAS)).capitalize()


def _name(rng: random.Random) -> str:
    return _word(rng, rng.choice([2, 2, 3]))


def _row_id(kind: str, seed: int, index: int) -> str:
    return hashlib.sha1(f"{kind}:{seed}:{index}".encode()).hexdigest()[:24]


def _squad_row(rng: random.Random, row_id: str) -> dict:
    place, founder, builder = _word(rng, 3), _name(rng), _name(rng)
    river, region = _word(rng, 2), _word(rng, 3)
    kind, trade = rng.choice(_PLACE_KINDS), rng.choice(_TRADES)
    building, role = rng.choice(_BUILDINGS), rng.choice(_ROLES)
    founded = rng.randint(1100, 1890)
    built = founded + rng.randint(20, 120)
    people = rng.randint(2, 95) * 100
    facts = {
        "founder": (f"{place} is a {kind} in the region of {region}, founded in {founded} by {founder}.", founder,
                    f"Who founded {place}?"),
        "founded": (None, str(founded), f"In which year was {place} founded?"),
        "trade": (f"For centuries the town was known for {trade}, which still employs many of its people.", trade,
                  f"What was {place} known for?"),
        "building": (f"Its oldest {building} was built in {built} by the {role} {builder}.", builder,
                     f"Who built the oldest {building} in {place}?"),
        "built": (None, str(built), f"When was the oldest {building} of {place} built?"),
        "river": (f"The {river} river runs through the centre, and about {people} people live along its banks.",
                  river, f"Which river runs through {place}?"),
        "people": (None, str(people), f"How many people live along the river in {place}?"),
        "region": (None, region, f"In which region is {place}?"),
    }
    sentences = [facts[k][0] for k in ("founder", "trade", "building", "river")]
    head, tail = sentences[0], sentences[1:]
    rng.shuffle(tail)
    context = " ".join([head, *tail])
    key = rng.choice(sorted(facts))
    _, answer, question = facts[key]
    start = context.index(answer)
    return {
        "id": row_id,
        "title": place,
        "context": context,
        "question": question,
        "answers": {"text": [answer], "answer_start": [start]},
    }


def _add_sub(rng: random.Random) -> tuple[str, str]:
    who, item = _name(rng), rng.choice(_ITEMS)
    have, buy, give = rng.randint(5, 60), rng.randint(2, 40), rng.randint(1, 30)
    after_buy = have + buy
    give = min(give, after_buy)
    left = after_buy - give
    question = (f"{who} has {have} {item}. {who} buys {buy} more and then gives {give} to a friend. "
                f"How many {item} does {who} have now?")
    answer = (f"{who} starts with {have} {item}. After buying {buy}, {who} has {have} + {buy} = {after_buy}. "
              f"After giving away {give}, {who} has {after_buy} - {give} = {left}. The answer is {left}.")
    return question, answer


def _multiply(rng: random.Random) -> tuple[str, str]:
    who, item, box = _name(rng), rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    boxes, per, extra = rng.randint(2, 12), rng.randint(3, 25), rng.randint(0, 9)
    packed = boxes * per
    total = packed + extra
    question = (f"{who} has {boxes} {box} with {per} {item} in each, and {extra} loose {item}. "
                f"How many {item} does {who} have in total?")
    answer = (f"The {box} hold {boxes} x {per} = {packed} {item}. Adding the {extra} loose ones gives "
              f"{packed} + {extra} = {total}. The answer is {total}.")
    return question, answer


def _share(rng: random.Random) -> tuple[str, str]:
    who, item = _name(rng), rng.choice(_ITEMS)
    friends, each = rng.randint(2, 9), rng.randint(2, 15)
    total = friends * each
    question = f"{who} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?"
    answer = f"Each friend gets {total} / {friends} = {each} {item}. The answer is {each}."
    return question, answer


def _percent(rng: random.Random) -> tuple[str, str]:
    who = _name(rng)
    price = rng.randint(1, 20) * 20  # a multiple of 20, so every discount below is whole
    pct = rng.choice([10, 20, 25, 30, 40, 50])
    off = price * pct // 100
    paid = price - off
    question = f"A coat costs {price} dollars. {who} gets a discount of {pct} percent. How much does {who} pay?"
    answer = (f"The discount is {pct} / 100 x {price} = {off} dollars. {who} pays {price} - {off} = {paid} dollars. "
              f"The answer is {paid}.")
    return question, answer


def _speed(rng: random.Random) -> tuple[str, str]:
    who = _name(rng)
    speed, hours = rng.randint(3, 90), rng.randint(2, 9)
    distance = speed * hours
    question = f"{who} travels at {speed} kilometres per hour for {hours} hours. How far does {who} travel?"
    answer = f"Distance is speed times time: {speed} x {hours} = {distance} kilometres. The answer is {distance}."
    return question, answer


def _ages(rng: random.Random) -> tuple[str, str]:
    older, younger = _name(rng), _name(rng)
    age, gap, years = rng.randint(3, 30), rng.randint(2, 25), rng.randint(2, 15)
    older_now = age + gap
    total = older_now + years + age + years
    question = (f"{younger} is {age} years old and {older} is {gap} years older. "
                f"What will their ages add up to in {years} years?")
    answer = (f"{older} is {age} + {gap} = {older_now} now. In {years} years {older} will be {older_now + years} "
              f"and {younger} will be {age + years}, so together {older_now + years} + {age + years} = {total}. "
              f"The answer is {total}.")
    return question, answer


_PROBLEMS: list[Callable[[random.Random], tuple[str, str]]] = [_add_sub, _multiply, _share, _percent, _speed, _ages]


def squad_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` SQuAD-schema rows; every answer is a span of its context at ``answer_start``."""
    rng = random.Random(f"squad:{seed}")
    return [_squad_row(rng, _row_id("squad", seed, i)) for i in range(n)]


def orca_math_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` Orca-Math-schema rows (question, answer) with correct arithmetic."""
    rng = random.Random(f"orca-math:{seed}")
    return [dict(zip(("question", "answer"), rng.choice(_PROBLEMS)(rng))) for _ in range(n)]
