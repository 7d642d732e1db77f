"""Document functions for the local zero-shot tasks (lm-eval's own, for the same data)."""

import re


def copa_text(doc):
    connector = {"cause": "because", "effect": "therefore"}[doc["question"]]
    return doc["premise"].strip()[:-1] + f" {connector}"


def _lower_first(choice):
    return choice[0].lower() + choice[1:]


def copa_choice(doc):
    return [" " + _lower_first(doc["choice1"]), " " + _lower_first(doc["choice2"])]


def copa_target(doc):
    return int(doc["label"])


def winogrande_text(doc):
    return {"1": 0, "2": 1}[doc["answer"]]


def winogrande_target(doc):
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def winogrande_choice(doc):
    idx = doc["sentence"].index("_")
    return [doc["sentence"][:idx] + opt for opt in (doc["option1"], doc["option2"])]


def _hellaswag_clean(text):
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_docs(dataset):
    def one(doc):
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": _hellaswag_clean(doc["activity_label"] + ": " + ctx),
            "choices": [_hellaswag_clean(e) for e in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(one)
