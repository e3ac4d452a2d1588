import sys

from pjray.cli import main

sys.exit(main())
