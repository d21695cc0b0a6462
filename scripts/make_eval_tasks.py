"""Writes the jsonl data of the lm-eval tasks shipped in src/hybridlm/eval/tasks (deterministic; rerun to rebuild).

words_{train,test}.jsonl: two objects each hold a random 4-letter word and one of them is asked for (`target`), with
four `choices`: both held words and two others. hybridlm_recall asks which word the object holds (chance 1/4, copying
any word from the context 1/2, looking it up 1); hybridlm_copy and hybridlm_copy_gen show `target` alone and ask for
it again (chance 1/4; a tiny model learns to copy in a few seconds).
code_test.jsonl: short Python functions for perplexity.
"""
import json
import os
import random
import string

OUT = os.path.join(os.path.dirname(__file__), "..", "src", "hybridlm", "eval", "tasks")
OBJECTS = ["box", "lamp", "door", "cup", "bag", "jar", "pen", "coat", "shelf", "drawer"]


def word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(4))


def recall_doc(rng: random.Random) -> dict:
    objects = rng.sample(OBJECTS, 2)
    words = []
    while len(words) < 4:  # two held words and two distractors, all distinct
        w = word(rng)
        if w not in words:
            words.append(w)
    asked = rng.randrange(2)
    choices = words[:]
    rng.shuffle(choices)
    return {"context": " ".join(f"The {o} holds {w}." for o, w in zip(objects, words)), "item": objects[asked],
            "choices": choices, "answer": choices.index(words[asked]), "target": words[asked]}


CODE = [
    "def add(a, b):\n    return a + b\n",
    "def mean(xs):\n    if not xs:\n        raise ValueError('mean of an empty list')\n    return sum(xs) / len(xs)\n",
    "def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n",
    "def flatten(rows):\n    out = []\n    for row in rows:\n        out.extend(row)\n    return out\n",
    "def count_words(text):\n    counts = {}\n    for w in text.split():\n        counts[w] = counts.get(w, 0) + 1\n"
    "    return counts\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, x):\n        self.items.append(x)\n\n"
    "    def pop(self):\n        return self.items.pop()\n\n    def __len__(self):\n        return len(self.items)\n",
    "def read_lines(path):\n    with open(path) as f:\n        return [line.rstrip('\\n') for line in f]\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n"
    "            return False\n        i += 1\n    return True\n",
    "def chunks(xs, size):\n    for i in range(0, len(xs), size):\n        yield xs[i:i + size]\n",
    "import os\n\n\ndef find_files(root, suffix):\n    for dirpath, _, names in os.walk(root):\n"
    "        for name in names:\n"
    "            if name.endswith(suffix):\n                yield os.path.join(dirpath, name)\n",
    "def merge(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n"
    "    return out + a[i:] + b[j:]\n",
]


def write(name: str, rows: list[dict]):
    with open(os.path.join(OUT, name), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    write("words_train.jsonl", [recall_doc(random.Random(f"train{i}")) for i in range(500)])
    write("words_test.jsonl", [recall_doc(random.Random(f"test{i}")) for i in range(200)])
    write("code_test.jsonl", [{"text": t} for t in CODE])
