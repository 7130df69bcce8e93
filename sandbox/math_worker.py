"""A math worker process: math-verify on one (gold, prediction) pair per request.

Trusted code, run by verifiers.py as `python -I -S -c <this file's text, read once at import> <site folders>`: a
worker never reads this file from disk, so a program that rewrote it (where writes are not stopped) changes no
later reward. Protocol: one JSON request `[id, gold, pred]` per stdin line (pred null: does the gold parse?), one
`id 0|1` line back; the worker exits at the end of its input (the parent closed the pipe or died)."""

import json
import logging
import os
import sys

PARSE_ALARM_S = 1  # math-verify's own SIGALRM timeouts (whole seconds); the caller's hard timeout is verifiers'
VERIFY_ALARM_S = 2
WORKER_MEMORY = 4 << 30  # address-space limit of a worker


def verify_pair(gold_latex: str, pred_latex: str) -> bool:
    """math-verify: gold first, boxed-only extraction of the prediction, no string fallbacks.
    Runs in the worker's main thread: math-verify's timeouts use SIGALRM."""
    from math_verify import LatexExtractionConfig, parse, verify

    gold = parse(
        gold_latex,
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
        fallback_mode="no_fallback",
        parsing_timeout=PARSE_ALARM_S,
    )
    if not gold:
        return False
    pred = parse(
        pred_latex,
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)],
        fallback_mode="no_fallback",
        extraction_mode="first_match",
        parsing_timeout=PARSE_ALARM_S,
    )
    if not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=VERIFY_ALARM_S))


def gold_parses(gold_latex: str) -> bool:
    """Does the gold parse as verify_pair parses it? (No prediction can match a gold that does not.)"""
    from math_verify import LatexExtractionConfig, parse

    extraction = [LatexExtractionConfig(boxed_match_priority=0)]
    return bool(parse(gold_latex, extraction_config=extraction, fallback_mode="no_fallback", parsing_timeout=PARSE_ALARM_S))


def main(site_folders: list[str]) -> None:
    import resource

    sys.path.extend(site_folders)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard == resource.RLIM_INFINITY or hard > WORKER_MEMORY:
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # stray prints of any library cannot corrupt the protocol
    logging.disable(logging.CRITICAL)
    import math_verify  # noqa: F401 - import before the first request

    replies.write(b"ready\n")
    for line in sys.stdin.buffer:
        try:
            request_id, gold, pred = json.loads(line)
        except ValueError:
            continue
        try:
            ok = gold_parses(gold) if pred is None else verify_pair(gold, pred)
        except BaseException:  # noqa: BLE001 - math-verify's TimeoutException is a BaseException
            ok = False
        replies.write(f"{request_id} {int(ok)}\n".encode())


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
