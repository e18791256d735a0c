import sys

from ddp_lab.doctor import main

sys.exit(main())
