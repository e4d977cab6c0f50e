"""Writes `stories.txt`: short children's stories composed by this project.

Every word and template below was written for paged_jax; nothing is copied
from any other text, so the output carries the repository's own licence.
The generator is seeded, so `python -m experiments.data.make_stories` always
reproduces the committed file byte for byte.

Stories are separated by a blank line; the trainer frames each with BOS/EOS.
"""

from __future__ import annotations

import os
import random

NAMES = ["Lily", "Tom", "Mia", "Ben", "Sara", "Max", "Anna", "Leo", "Emma", "Sam",
         "Lucy", "Jack", "Nora", "Finn", "Rosa", "Otto", "Ivy", "Hugo", "Zoe", "Theo"]
ANIMALS = ["cat", "dog", "bird", "rabbit", "fox", "owl", "duck", "frog", "bear", "mouse"]
PLACES = ["the park", "the forest", "the garden", "the beach", "the farm", "the hill",
          "the river", "the village", "the meadow", "the old mill"]
THINGS = ["a red ball", "a blue kite", "a small boat", "a shiny stone", "a wooden box",
          "a yellow hat", "a little drum", "a green book", "a paper star", "a silver key"]
FEELINGS = ["happy", "sad", "scared", "proud", "curious", "tired", "excited", "brave"]
WEATHER = ["The sun was warm and bright.", "It was a cold and windy day.",
           "Soft rain fell on the roof.", "The sky was full of white clouds.",
           "Snow covered the ground like a blanket.", "A gentle wind moved the trees."]
TIMES = ["One morning", "One day", "Later that day", "In the evening", "The next day",
         "After lunch", "At night"]
OPENINGS = ["Once upon a time, there was a little {kind} named {name}.",
            "Once upon a time, in a small house near {place}, lived a {kind} named {name}.",
            "Once upon a time, a {kind} called {name} lived by {place}.",
            "There was once a kind {kind} named {name} who loved {place}."]
KINDS = ["girl", "boy", "cat", "dog", "rabbit", "bear", "bird", "mouse"]


def _pronoun(name_kind):
  return {"girl": ("she", "her"), "boy": ("he", "his")}.get(name_kind, ("it", "its"))


def _story(rng: random.Random) -> str:
  name = rng.choice(NAMES)
  kind = rng.choice(KINDS)
  he, his = _pronoun(kind)
  if kind not in ("girl", "boy"):
    he, his = ("she", "her") if rng.random() < 0.5 else ("he", "his")
  place, place2 = rng.sample(PLACES, 2)
  thing = rng.choice(THINGS)
  friend = rng.choice([n for n in NAMES if n != name])
  animal = rng.choice(ANIMALS)
  feel, feel2 = rng.sample(FEELINGS, 2)
  s = [rng.choice(OPENINGS).format(kind=kind, name=name, place=place)]
  s.append(f"{name} had {thing}, and {he} liked it very much.")
  s.append(rng.choice(WEATHER))
  t = rng.choice(TIMES)
  s.append(f"{t}, {name} went to {place2} with {his} friend {friend}.")
  event = rng.randrange(5)
  if event == 0:
    s.append(f"They saw a {animal} sitting under a big tree.")
    s.append(f"The {animal} looked {feel}. \"Hello,\" said {name}. \"Why are you {feel}?\"")
    s.append(f"\"I lost my way home,\" said the {animal}.")
    s.append(f"{name} and {friend} helped the {animal} find its home near {place}.")
    s.append(f"The {animal} was so glad that it gave them a big smile.")
  elif event == 1:
    s.append(f"On the way, {name} dropped {thing} and could not find it.")
    s.append(f"{name} felt {feel}. {friend} said, \"Do not worry. We will look together.\"")
    s.append(f"They looked under the leaves and behind the rocks.")
    s.append(f"At last, a little {animal} came and showed them where it was.")
    s.append(f"\"Thank you!\" said {name}, and {he} hugged {his} friend.")
  elif event == 2:
    s.append(f"They wanted to build a tall tower with sticks and stones.")
    s.append(f"The tower fell down once, and then it fell down again.")
    s.append(f"{friend} wanted to stop, but {name} said, \"Let us try one more time.\"")
    s.append(f"This time they worked slowly and carefully, and the tower stood tall.")
    s.append(f"They felt {feel} and laughed until the sun went down.")
  elif event == 3:
    s.append(f"They found a {animal} that was hungry and cold.")
    s.append(f"{name} shared {his} bread with the {animal}, and {friend} gave it some water.")
    s.append(f"The {animal} followed them all the way back to the house.")
    s.append(f"Mom said the {animal} could stay for the night.")
    s.append(f"{name} was {feel}, and the {animal} slept by the warm fire.")
  else:
    s.append(f"{friend} wanted to play with {thing}, but {name} did not want to share.")
    s.append(f"{friend} felt {feel2} and walked away.")
    s.append(f"{name} sat alone and thought about it for a long time.")
    s.append(f"Then {he} ran to {friend} and said, \"I am sorry. Let us play together.\"")
    s.append(f"They played with {thing} all afternoon, and it was more fun with two.")
  endings = [f"From that day on, {name} and {friend} were the best of friends.",
             f"{name} learned that it is good to help others.",
             f"That night, {name} went to bed {feel2} and dreamed of {place2}.",
             f"And they all lived happily ever after.",
             f"{name} smiled, because it had been a very good day."]
  s.append(rng.choice(endings))
  return " ".join(s)


def main(path: str = os.path.join(os.path.dirname(__file__), "stories.txt"),
         target_bytes: int = 400_000, seed: int = 0) -> None:
  rng = random.Random(seed)
  stories, total = [], 0
  while total < target_bytes:
    st = _story(rng)
    stories.append(st)
    total += len(st) + 2
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n\n".join(stories) + "\n")
  print(f"wrote {len(stories)} stories, {total} bytes to {path}")


if __name__ == "__main__":
  main()
