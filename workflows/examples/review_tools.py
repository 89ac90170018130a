"""The python step of review_topics.yaml: one row per (review, topic), the topics read
from each row's JSON answer and normalised. A row-count-changing, parse-and-explode step
that the filter language cannot express; workflows import it from this directory.

    topics:
      from: label
      python: review_tools:explode_topics
      format: pandas
"""
import json

import pandas as pd


def explode_topics(df: pd.DataFrame) -> pd.DataFrame:
    """review_id, topic: each distinct topic of a row's answer, lower-cased and stripped.
    Error rows and answers that are not a JSON object with a `topics` list give none."""
    rows = []
    for review_id, error, text in zip(df["review_id"], df["error"], df["generated_text"]):
        if not pd.isna(error) or pd.isna(text):  # nulls arrive as None or NaN
            continue
        try:
            topics = json.loads(text).get("topics")
        except (ValueError, AttributeError):
            continue
        if not isinstance(topics, list):
            continue
        seen = dict.fromkeys(t.strip().lower() for t in topics if isinstance(t, str) and t.strip())
        rows += [(review_id, topic) for topic in seen]
    return pd.DataFrame(rows, columns=["review_id", "topic"]).astype(
        {"review_id": "int64", "topic": "string"})
