"""Multi-turn chat conversations that re-send their images every turn, as chat applications
do: the load the prefix and encoder caches exist for.

Turn `t` of a conversation is its first user message (the images and a text), then for
every earlier turn a fixed assistant reply and the next user text. The replies are made up
rather than the server's own, so that every body can be built before any is sent; a
server's cache still finds each turn's prompt in the next one.
"""

from __future__ import annotations

import random
from collections.abc import Callable

# Short common words: most tokenizers give one token to each (with its leading space).
WORDS = tuple("""
the of and to in is it you that he was for on are as with his they at be this have from or
one had by word but not what all were we when your can said there use an each which she do
how their if will up other about out many then them these so some her would make like him
into time has look two more write go see number no way could people my than first water
been call who oil its now find long down day did get come made may part over new sound take
only little work know place year live me back give most very after thing our just name good
man think say great where help through much before line right too mean old any same tell
boy follow came want show also around form three small set put end does another well large
must big even such because turn here why ask went men read need land different home us move
try kind hand picture again change off play spell air away animal house point page letter
""".split())


def words(seed: object, count: int) -> str:
    """`count` words drawn from WORDS, a function of `seed` only."""
    rng = random.Random(str(seed))
    return " ".join(rng.choices(WORDS, k=count))


def conversation_messages(image_urls: list[str], turn: int, user_text: Callable[[int], str],
                          reply_text: Callable[[int], str], kind: str = "image") -> list[dict]:
    """The OpenAI `messages` of turn `turn` (0-based): `user_text(t)` is the user's text of
    turn t, `reply_text(t)` the assistant's answer to it; the URLs are images' or, with
    `kind` "video", videos'."""
    first = [{"type": f"{kind}_url", f"{kind}_url": {"url": url}} for url in image_urls]
    first.append({"type": "text", "text": user_text(0)})
    messages: list[dict] = [{"role": "user", "content": first if image_urls else user_text(0)}]
    for t in range(1, turn + 1):
        messages.append({"role": "assistant", "content": reply_text(t - 1)})
        messages.append({"role": "user", "content": user_text(t)})
    return messages
