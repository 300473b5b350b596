import sys

from kvtier_app.cli import main

sys.exit(main())
