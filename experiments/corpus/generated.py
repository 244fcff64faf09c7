"""An embedded, generated English-like corpus for byte-level language modelling.

The text comes from a small hand-written probabilistic grammar, not from any
existing document, so it needs no download and has no licence attached. It is
meant to be learnable at several scales:

* spelling and punctuation (a closed vocabulary of a few hundred words);
* local syntax (determiners before adjectives before nouns, tense agreement);
* paragraph-level memory: each paragraph follows one named character, whose
  trade, home town, companion and favourite thing are fixed for the whole
  corpus and are mentioned again later in the paragraph, so predicting them
  well needs context well beyond the current sentence.

Only ``random.Random.random()`` is used, whose sequence for a given integer seed
Python guarantees across versions and platforms; every choice below is derived
from it, so the bytes are identical on every machine and in every process.
"""

from __future__ import annotations

import functools
import random

_SEED = 20241129

# name, pronoun set index, trade, home, companion, favourite thing.
_CAST = (
  ("Mira", 0, "baker", "Hollowmere", "a grey cat", "copper kettle"),
  ("Tobin", 1, "ferryman", "Saltreach", "an old dog", "blue lantern"),
  ("Ansel", 1, "clockmaker", "Windle", "a tame crow", "silver key"),
  ("Odessa", 0, "weaver", "Brackenford", "a lame goat", "red shawl"),
  ("Perrin", 1, "shepherd", "Highcombe", "two sheepdogs", "willow flute"),
  ("Lark", 0, "cartographer", "Port Amsel", "a young apprentice", "brass compass"),
  ("Quill", 2, "lamplighter", "Ninefold", "a restless moth", "long ladder"),
  ("Hester", 0, "miller", "Dunmarrow", "a loud goose", "oak chest"),
  ("Jory", 1, "tinker", "Greywater", "a patient mule", "bag of nails"),
  ("Sable", 2, "beekeeper", "Thistledown", "a swarm of bees", "straw hat"),
  ("Corin", 1, "fisherman", "Saltreach", "a leaky boat", "knotted net"),
  ("Wren", 0, "herbalist", "Hollowmere", "a sleepy hedgehog", "mortar and pestle"),
)

# subject, object, possessive, reflexive; the verb forms below are all past tense
# so "they" needs no separate agreement.
_PRONOUNS = (
  ("she", "her", "her", "herself"),
  ("he", "him", "his", "himself"),
  ("they", "them", "their", "themselves"),
)

_PLACES = (
  "Hollowmere",
  "Saltreach",
  "Windle",
  "Brackenford",
  "Highcombe",
  "Port Amsel",
  "Ninefold",
  "Dunmarrow",
  "Greywater",
  "Thistledown",
  "the Fenwick marshes",
  "the Tallow hills",
  "the old quarry",
  "the river Esk",
  "the king's road",
)

_ADJECTIVES = (
  "small",
  "old",
  "quiet",
  "bright",
  "heavy",
  "narrow",
  "green",
  "warm",
  "cold",
  "tall",
  "broken",
  "wooden",
  "strange",
  "gentle",
  "crooked",
  "empty",
  "golden",
  "muddy",
  "tired",
  "clever",
  "patient",
  "hungry",
  "ancient",
  "shallow",
  "brittle",
  "sweet",
  "bitter",
  "pale",
  "dark",
  "curious",
  "noisy",
  "careful",
  "heavy-laden",
  "rusty",
  "soft",
  "sharp",
  "round",
  "wide",
  "faded",
  "lucky",
  "stubborn",
  "swift",
  "crimson",
  "silent",
  "foggy",
  "dusty",
  "bent",
  "proud",
)

_NOUNS = (
  "door",
  "window",
  "bridge",
  "basket",
  "lantern",
  "river",
  "field",
  "road",
  "letter",
  "coin",
  "bell",
  "barrel",
  "candle",
  "ladder",
  "rope",
  "stone",
  "garden",
  "well",
  "tower",
  "market",
  "boat",
  "cart",
  "wheel",
  "hammer",
  "loaf",
  "apple",
  "jar",
  "cloak",
  "map",
  "song",
  "story",
  "feather",
  "key",
  "clock",
  "fence",
  "orchard",
  "barn",
  "kettle",
  "needle",
  "thread",
  "mirror",
  "chair",
  "table",
  "roof",
  "chimney",
  "path",
  "meadow",
  "forest",
  "shore",
  "harbour",
  "mill",
  "gate",
  "ribbon",
  "pebble",
  "shell",
  "blanket",
  "pot",
  "spoon",
  "book",
  "drum",
  "flag",
  "sack",
  "bottle",
  "saddle",
  "anchor",
  "net",
  "pillow",
  "scarf",
  "boot",
  "wall",
  "staircase",
  "cellar",
  "attic",
  "wagon",
)

_CREATURES = (
  "fox",
  "heron",
  "badger",
  "owl",
  "horse",
  "sparrow",
  "hare",
  "trout",
  "beetle",
  "raven",
  "ox",
  "lamb",
  "otter",
  "wasp",
  "toad",
  "stag",
)

_PEOPLE = (
  "stranger",
  "child",
  "merchant",
  "soldier",
  "widow",
  "priest",
  "farmer",
  "sailor",
  "guard",
  "innkeeper",
  "messenger",
  "traveller",
  "neighbour",
  "scholar",
)

# (past tense, takes an object) pairs; the object is chosen from _NOUNS.
_TRANSITIVE = (
  "found",
  "carried",
  "opened",
  "mended",
  "painted",
  "sold",
  "bought",
  "lost",
  "cleaned",
  "counted",
  "lifted",
  "hid",
  "dropped",
  "polished",
  "borrowed",
  "returned",
  "broke",
  "filled",
  "emptied",
  "tied",
  "wrapped",
  "buried",
  "shared",
  "noticed",
  "guarded",
  "pushed",
  "pulled",
  "measured",
  "weighed",
  "sharpened",
  "packed",
  "carved",
  "traded",
  "stole",
  "inspected",
  "followed",
  "remembered",
  "forgot",
  "described",
  "admired",
)

_INTRANSITIVE = (
  "waited",
  "laughed",
  "slept",
  "wandered",
  "sang",
  "listened",
  "hurried",
  "rested",
  "worked",
  "whistled",
  "sighed",
  "paused",
  "shivered",
  "smiled",
  "frowned",
  "stumbled",
  "lingered",
  "prayed",
  "dreamed",
  "argued",
)

_MOTION = ("walked", "ran", "rode", "sailed", "climbed", "crept", "travelled", "marched")

_ADVERBS = (
  "slowly",
  "quickly",
  "quietly",
  "carefully",
  "suddenly",
  "gladly",
  "softly",
  "patiently",
  "nervously",
  "boldly",
  "lazily",
  "proudly",
  "gently",
  "eagerly",
  "wearily",
  "secretly",
  "loudly",
  "happily",
  "sadly",
  "calmly",
)

_PREPOSITIONS = (
  "near",
  "behind",
  "beside",
  "under",
  "above",
  "beyond",
  "inside",
  "across",
  "along",
  "past",
  "around",
  "below",
)

_TIMES = (
  "at dawn",
  "at noon",
  "at dusk",
  "before supper",
  "after the rain",
  "in the morning",
  "late that night",
  "on market day",
  "the next morning",
  "at the turn of the tide",
  "when the bells rang",
  "before the frost",
)

_SEASONS = ("spring", "summer", "autumn", "winter")

_WEATHER = (
  "The rain fell steadily",
  "A cold wind blew from the north",
  "The sun was low",
  "Fog lay over the water",
  "The sky was clear and pale",
  "Snow drifted past",
  "Thunder rolled in the distance",
  "The air smelled of smoke",
)

_NUMBERS = ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve")

_SAY = ("said", "whispered", "called", "replied", "muttered", "shouted")

_CONJ = ("and", "but", "so", "yet")

_SUBORD = ("When", "Because", "After", "Before", "Although", "While", "Since")

_FEELINGS = ("glad", "afraid", "tired", "hungry", "certain", "puzzled", "restless", "hopeful")


class _Writer:
  """The grammar, driven by one seeded generator."""

  def __init__(self, seed: int):
    self._random = random.Random(seed).random

  def pick(self, options, skew: bool = False):
    # Squaring the uniform draw favours the front of each list, which gives a
    # Zipf-like word frequency profile instead of a flat one.
    u = self._random()
    if skew:
      u *= u
    return options[int(u * len(options))]

  def chance(self, p: float) -> bool:
    return self._random() < p

  def noun_phrase(self, definite: bool | None = None) -> str:
    if definite is None:
      definite = self.chance(0.6)
    noun = self.pick(_NOUNS, skew=True)
    adjective = self.pick(_ADJECTIVES, skew=True) + " " if self.chance(0.45) else ""
    if definite:
      return f"the {adjective}{noun}"
    article = "an" if (adjective or noun)[0] in "aeiou" else "a"
    return f"{article} {adjective}{noun}"

  def other_subject(self) -> str:
    if self.chance(0.5):
      return "the " + self.pick(_PEOPLE, skew=True)
    return "the " + self.pick(_CREATURES, skew=True)

  def place_phrase(self) -> str:
    if self.chance(0.4):
      return f"{self.pick(_PREPOSITIONS)} {self.noun_phrase(definite=True)}"
    return f"{self.pick(('near', 'beyond', 'outside', 'far from'))} {self.pick(_PLACES)}"

  def clause(self, subject: str, pron: tuple[str, str, str, str], hero) -> str:
    """One past-tense clause about ``subject``; ``hero`` supplies recurring facts."""
    kind = self._random()
    adverb = self.pick(_ADVERBS, skew=True) + " " if self.chance(0.3) else ""
    if kind < 0.34:
      tail = " " + self.place_phrase() if self.chance(0.4) else ""
      return f"{subject} {adverb}{self.pick(_TRANSITIVE, skew=True)} {self.noun_phrase()}{tail}"
    if kind < 0.50:
      return f"{subject} {adverb}{self.pick(_INTRANSITIVE, skew=True)} {self.place_phrase()}"
    if kind < 0.62:
      destination = self.pick(_PLACES) if self.chance(0.7) else hero[3]
      return f"{subject} {adverb}{self.pick(_MOTION)} to {destination}"
    if kind < 0.72:
      return f"{subject} {self.pick(_TRANSITIVE)} {pron[2]} {hero[5]}"
    if kind < 0.80:
      return f"{subject} was {self.pick(_FEELINGS)}"
    if kind < 0.88:
      count = self.pick(_NUMBERS, skew=True)
      return f"{subject} {self.pick(_TRANSITIVE, skew=True)} {count} {self.pick(_NOUNS)}s"
    return f"{subject} saw {self.other_subject()} {self.place_phrase()}"

  def sentence(self, hero, pron, first: bool) -> str:
    name = hero[0]
    # A name after a long gap, otherwise a pronoun: coreference the model has to
    # resolve from the paragraph's opening.
    subject = name if first or self.chance(0.3) else pron[0]
    form = self._random()
    if form < 0.40:
      body = self.clause(subject, pron, hero)
      if self.chance(0.35):
        body += " " + self.pick(_TIMES)
      return body[0].upper() + body[1:] + "."
    if form < 0.58:
      left = self.clause(subject, pron, hero)
      right = self.clause(pron[0] if self.chance(0.6) else self.other_subject(), pron, hero)
      return left[0].upper() + left[1:] + f", {self.pick(_CONJ)} {right}."
    if form < 0.70:
      inner = self.clause(pron[0], pron, hero)
      outer = self.clause(name, pron, hero)
      return f"{self.pick(_SUBORD)} {inner}, {outer}."
    if form < 0.84:
      return self.dialogue(hero, pron)
    if form < 0.92:
      return f"{self.pick(_WEATHER)} {self.pick(_TIMES)}."
    return (
      f"{pron[0].capitalize()} thought of {hero[4]} and the {hero[5]} "
      f"{'waiting' if self.chance(0.5) else 'left'} in {hero[3]}."
    )

  def dialogue(self, hero, pron) -> str:
    speaker = hero[0] if self.chance(0.7) else "the " + self.pick(_PEOPLE, skew=True)
    verb = self.pick(_SAY, skew=True)
    u = self._random()
    if u < 0.3:
      return f'"Where is the {self.pick(_NOUNS, skew=True)}?" asked {speaker}.'
    if u < 0.55:
      # Only the hero introduces themselves, so the trade and town must match.
      speaker = hero[0]
      line = f"I am a {hero[2]} from {hero[3]}"
    elif u < 0.75:
      line = f"We must reach {self.pick(_PLACES)} {self.pick(_TIMES)}"
    else:
      line = f"Bring me {self.noun_phrase(definite=False)}, and quickly"
    return f'"{line}," {verb} {speaker}.'

  def paragraph(self, number: int) -> str:
    hero = self.pick(_CAST)
    pron = _PRONOUNS[hero[1]]
    opening = (
      f"{number}. In the {self.pick(_SEASONS)}, {hero[0]} the {hero[2]} of "
      f"{hero[3]} set out with {hero[4]}."
    )
    parts = [opening]
    for i in range(3 + int(self._random() * 6)):
      parts.append(self.sentence(hero, pron, first=i == 0))
    # Closing on facts stated only in the opening line rewards long context.
    parts.append(f"At last {hero[0]} came home to {hero[3]} and put away the {hero[5]}.")
    return " ".join(parts)


@functools.lru_cache(maxsize=4)
def default_corpus(num_bytes: int = 1_200_000) -> bytes:
  """Returns the first ``num_bytes`` bytes of the embedded generated corpus.

  The text is ASCII, paragraphs separated by blank lines, and a prefix of any
  longer request, so two callers asking for different sizes see the same text.

  Args:
    num_bytes: Length of the returned text in bytes; must be positive.

  Returns:
    Exactly ``num_bytes`` bytes of ASCII text, identical on every machine.
  """
  if num_bytes <= 0:
    raise ValueError(f"num_bytes must be positive, got {num_bytes}")
  writer = _Writer(_SEED)
  paragraphs = []
  total = 0
  number = 1
  while total < num_bytes:
    text = writer.paragraph(number) + "\n\n"
    paragraphs.append(text)
    total += len(text)
    number += 1
  return "".join(paragraphs)[:num_bytes].encode("ascii")
