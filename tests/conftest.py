import os

import torch

# The test machine has few cores and several tests start worker processes.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
