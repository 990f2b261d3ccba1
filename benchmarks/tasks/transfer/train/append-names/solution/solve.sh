#!/usr/bin/env bash
cd /app
printf 'carol\n' >> names.txt
