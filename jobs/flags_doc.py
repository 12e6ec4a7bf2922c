"""Write docs/flags.md, the reference of every flag, from the config fields.

python jobs/flags_doc.py      # after changing a field; tests/test_docs.py checks the file
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing

from ray_ddp.config.flags import flags_markdown  # noqa: E402

if __name__ == "__main__":
    with open(os.path.join(ROOT, "docs", "flags.md"), "w") as file:
        file.write(flags_markdown())
