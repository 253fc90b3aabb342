"""One of test_corpus.py's concurrent first uses: `python -m tests.data.corpus_worker`.

Prepares (or finds) the embedded corpus with a 512-piece tokenizer in $MOETEXT_DATA_DIR and
prints `RESULT {"paths": [dataset dir, tokenizer], "stderr": what it printed there}`. A process
of its own, because the corpus lock is for processes (xdist workers, the hosts of a run).
"""

from __future__ import annotations

import contextlib
import io
import json

from moetext.data import corpus


def main() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        paths = corpus.ensure_python_docs(vocab_size=512)
    print("RESULT " + json.dumps({"paths": paths, "stderr": err.getvalue()}), flush=True)


if __name__ == "__main__":
    main()
