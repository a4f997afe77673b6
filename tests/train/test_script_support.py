"""What the Python test scripts of tests/train share: how they skip for want of a dependency."""
import os
import sys

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


def skip(why):
    """Exit 77 (CTest: skipped); under SHOAL_REQUIRE_ORACLES=1 (CI, where the set-up installs
    everything) a missing dependency is a failure instead."""
    if os.environ.get("SHOAL_REQUIRE_ORACLES") == "1":
        print("FAILED: %s (required: SHOAL_REQUIRE_ORACLES=1)" % why)
        sys.exit(1)
    print("skipped: %s" % why)
    sys.exit(77)


def require_fashion_mnist():
    if not os.path.exists(os.path.join(FASHION_MNIST, "train-images-idx3-ubyte.gz")):
        skip("Fashion-MNIST is not installed")
