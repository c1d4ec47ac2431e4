import os
import sys

# Tests import the package from the checkout without an install step too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
