"""``python -m pipeline.serve``: ``newsvec serve``."""
import sys

from pipeline.serve.main import main

sys.exit(main())
