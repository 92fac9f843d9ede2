import sys

from validate.loop import main

sys.exit(main())
