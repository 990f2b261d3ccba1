"""mitmproxy entry script: ``mitmdump -s addon/polar.py --mode reverse:http://127.0.0.1:8000``.

The addon itself lives in ``polar_proxy.addon`` (importable, testable); this file only hands an
instance to mitmproxy.
"""

from polar_proxy.addon import Polar
from polar_proxy.contentview import PolarContentView

addons = [Polar(), PolarContentView()]
