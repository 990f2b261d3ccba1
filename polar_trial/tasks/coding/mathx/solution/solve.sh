#!/usr/bin/env bash
cd /app
printf 'import math\ndef is_prime(n):\n    return n > 1 and all(n %% k for k in range(2, int(n ** 0.5) + 1))\ndef gcd(a, b):\n    return math.gcd(a, b)\n' > mathx.py
